"""A run's plots drawn by helper processes, so `kvsim run` does not wait for matplotlib.

The helpers start with the command and load matplotlib while it simulates; once the run folder
holds its tables, config and summary, each draws its share of the PNGs (the same files
`write_plots` draws), side by side. On a machine with a spare core the command then waits only
for the longest share's drawing, not for the import and every plot in turn. Each helper is a
fresh interpreter (`python -c`), told the folder on its stdin.

The helpers keep the command's CPU priority: the command waits on them at the end, so a lowered
priority (they once ran at nice 19) is a priority inversion. Beside other busy processes (a
sweep's workers, a test suite's) a nice-19 helper got about 1.5% of a core and the command
waited minutes for plots it draws in seconds alone; what they take from the simulation on a
machine with no spare core is matplotlib's import, which the drawing pays anyway.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvsim.sim.engine.run import RunResult

# the plots each helper draws (together `plots.PLOTS`): the block plot alone takes about as long as the other two
SHARES = (("blocks.png",), ("hit_rate.png", "latency.png"))
NAMES = tuple(name for share in SHARES for name in share)
_SERVE = "from kvsim.sim.studies.plot_workers import serve; serve()"
TIMEOUT = 600.0  # seconds `draw` waits for its helpers: a few alone, a minute or two beside busy processes
IDEAL = "--ideal"  # then the workload as JSON: the helper drawing hit_rate.png computes its ideal hit rate


class PlotWorkers:
    """Helper processes, one per share of the plots; `draw` hands each the run folder and
    waits. Use as a context manager: helpers never asked to draw are stopped at the end."""

    def __init__(self, shares: tuple[tuple[str, ...], ...] = SHARES, workload: dict | None = None,
                 timeout: float = TIMEOUT):
        """`workload` (`path`, `format`, `seed`, `block_size`; path None: the embedded one): the
        helper that draws hit_rate.png reads it while the run simulates, for the ideal hit rate.
        `timeout`: seconds `draw` waits for the helpers before it stops them and draws their shares."""
        self.timeout = timeout
        self._helpers: list[tuple[subprocess.Popen, tuple[str, ...]]] = []
        for share in shares:
            extra = [IDEAL, json.dumps(workload)] if workload is not None and "hit_rate.png" in share else []
            proc = subprocess.Popen([sys.executable, "-c", _SERVE, *share, *extra], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            self._helpers.append((proc, share))

    def __enter__(self) -> PlotWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def draw(self, result: RunResult, folder: Path) -> None:
        """Draw `result`'s plots into `folder`, which already holds its tables, config and
        summary. A share whose helper is gone, or has not answered within `timeout` seconds of
        the call (it is stopped, and a line on stderr says so), draws here instead; a helper's own
        error raises RuntimeError with its traceback."""
        asked, here, failed = [], [], []
        for proc, share in self._helpers:
            try:
                proc.stdin.write(str(folder) + "\n")
                proc.stdin.flush()  # (`communicate` closes it)
                asked.append((proc, share))
            except OSError:  # it is gone
                here.append(share)
        deadline = time.monotonic() + self.timeout
        for proc, share in asked:
            try:
                reply, _ = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                sys.stderr.write(f"plot helper for {', '.join(share)} gave no answer in {self.timeout:g} s: "
                                 "stopped, and its plots drawn here\n")
                here.append(share)
                continue
            except OSError:  # (its stdin already gone: it died)
                proc.wait()
                here.append(share)
                continue
            if reply.endswith("drawn\n") and proc.returncode == 0:
                continue
            if "Traceback" in reply:
                failed.append(reply)
            else:  # it died before it could answer
                here.append(share)
        self.close()
        if failed:
            raise RuntimeError("drawing the plots failed:\n" + "\n".join(failed))
        if here:
            from kvsim.sim.studies.plots import write_plots

            for share in here:
                write_plots(result, folder, share)

    def close(self) -> None:
        """Stop the helpers: one that drew has exited; one that did not is stopped at once,
        even mid-import, so a command that fails does not wait for it."""
        for proc, _ in self._helpers:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None and not pipe.closed:
                    with contextlib.suppress(OSError):  # (a dead helper's stdin: its buffered line cannot go)
                        pipe.close()
        self._helpers = []


def _ideal(spec: dict) -> float:
    """The workload's token hit rate with an infinite cache (`kvsim workload stats`)."""
    from kvsim.workloads.default import default_workload
    from kvsim.workloads.stats import describe
    from kvsim.workloads.traces import load_workload

    wl = default_workload(spec["seed"]) if spec["path"] is None else load_workload(spec["path"], spec["format"])
    return describe(wl, spec["block_size"]).ideal_token_hit_rate


def serve() -> None:
    """A helper's main: load the plotting stack, then draw the plots named on the command line
    into the run folder named on stdin; prints 'drawn' (or the traceback)."""
    import traceback

    import pandas as pd

    from kvsim.sim.engine.config import SimConfig
    from kvsim.sim.engine.run import RunResult
    from kvsim.sim.studies import plots
    from kvsim.workloads.files import read_json

    args = sys.argv[1:]
    share = tuple(args[: args.index(IDEAL)] if IDEAL in args else args)
    ideal: list[float] = []
    if IDEAL in args:  # computed while the run simulates (a pass over the workload takes seconds)
        spec = json.loads(args[args.index(IDEAL) + 1])
        worker = threading.Thread(target=lambda: ideal.append(_ideal(spec)), daemon=True)
        worker.start()
    plots.warm_up()
    line = sys.stdin.readline().rstrip("\n")
    if not line:  # the command ended without plots
        return
    try:
        folder = Path(line)
        summary = read_json(folder / "summary.json")
        cfg = SimConfig.from_run_config(read_json(folder / "config.json"))
        requests = pd.read_parquet(folder / "requests.parquet") if "latency.png" in share else pd.DataFrame()
        if IDEAL in args:
            worker.join()
            if ideal:  # (a workload it could not read gives no line, not a failure)
                summary = {**summary, "ideal_hit_rate": ideal[0]}
        groups = folder / "groups.parquet"
        usage = pd.read_parquet(groups) if "blocks.png" in share and groups.is_file() else None
        result = RunResult(cfg, summary["workload"], folder / "steps.parquet", requests, summary, group_usage=usage)
        plots.write_plots(result, folder, share)
        print("drawn", flush=True)
    except Exception:  # noqa: BLE001 - the command reports it
        print(traceback.format_exc(), flush=True)
    os._exit(0)  # the files are closed; tearing down matplotlib and pandas would only keep the command waiting
