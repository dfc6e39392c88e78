"""A run's plots drawn by helper processes, so `kvsim run` does not wait for matplotlib.

The helpers start with the command and load matplotlib while it simulates; once the run
folder holds its tables, each draws its share of the PNGs (the same files `write_plots`
draws), side by side. On a machine with a spare core the command then waits only for the
longest share's drawing, not for the import and every plot in turn. They are spawned, not
forked: the command holds pyarrow's threads by then.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sim.engine.run import RunResult

# the plots each helper draws (together `plots.PLOTS`): the block plot alone takes about as long as the other two
SHARES = (("blocks.png",), ("hit_rate.png", "latency.png"))
NAMES = tuple(name for share in SHARES for name in share)


class PlotWorkers:
    """Helper processes, one per share of the plots; `draw` hands each the run folder and
    waits. Use as a context manager: helpers never asked to draw are stopped at the end."""

    def __init__(self, shares: tuple[tuple[str, ...], ...] = SHARES):
        ctx = mp.get_context("spawn")
        self._helpers: list[tuple[mp.Process, Connection, tuple[str, ...]]] = []
        for share in shares:
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(theirs, share), name="kvsim-plots", daemon=True)
            proc.start()
            theirs.close()
            self._helpers.append((proc, ours, share))

    def __enter__(self) -> PlotWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def draw(self, result: RunResult, folder: Path) -> None:
        """Draw `result`'s plots into `folder`, which already holds its tables and summary. A
        share whose helper died draws here instead; a helper's own error raises RuntimeError
        with its traceback."""
        job = (str(folder), result.workload, result.config.to_dict(), result.summary)
        asked, here, failed = [], [], []
        for _, conn, share in self._helpers:
            try:
                conn.send(job)
                asked.append((conn, share))
            except OSError:  # it is gone
                here.append(share)
        for conn, share in asked:
            try:
                error = conn.recv()
            except EOFError:
                here.append(share)
                continue
            if error:
                failed.append(error)
        self.close()
        if failed:
            raise RuntimeError("drawing the plots failed:\n" + "\n".join(failed))
        if here:
            from sim.studies.plots import write_plots

            for share in here:
                write_plots(result, folder, share)

    def close(self) -> None:
        """Stop the helpers: one that drew has exited or is exiting; one that did not is stopped
        at once, even mid-import, so a command that fails does not wait for it."""
        for proc, conn, _ in self._helpers:
            conn.close()
            if proc.is_alive():
                proc.terminate()
            proc.join()
        self._helpers = []


def _serve(conn: Connection, share: tuple[str, ...]) -> None:
    """A helper: load the plotting stack now (yielding the CPU to the simulation), then draw
    `share` of the first run folder sent."""
    os.nice(19)
    import pandas as pd

    from sim.engine.config import SimConfig
    from sim.engine.run import RunResult
    from sim.studies import plots

    plots.warm_up()
    try:
        job = conn.recv()
    except EOFError:  # the command ended without plots
        return
    try:
        folder, workload, cfg, summary = job
        folder = Path(folder)
        requests = pd.read_parquet(folder / "requests.parquet") if "latency.png" in share else pd.DataFrame()
        result = RunResult(SimConfig.from_dict(cfg), workload, folder / "steps.parquet", requests, summary)
        plots.write_plots(result, folder, share)
        conn.send(None)
    except Exception:  # noqa: BLE001 - the command reports it
        conn.send(traceback.format_exc())
    conn.close()
    os._exit(0)  # the files are closed; tearing down matplotlib and pandas would only keep the command waiting
