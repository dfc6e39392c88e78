"""The run folder: what one simulation leaves on disk, and reading it back.

A run folder holds `config.json`, `steps.parquet`, `requests.parquet`,
`summary.json`, `ops.parquet` and `op_tokens.parquet` (only with
`record_ops`: what `kvsim gpu-replay` reads), `groups.parquet` (only for a model in vLLM's
hybrid KV-cache groups: the blocks each group held after each step) and PNG plots. `config.json`
holds the resolved `num_gpu_blocks` and, for a model in hybrid groups, each group's kind, window and
block size (`kv_cache_groups`, what `kvsim gpu-replay` checks each group by). Folders are written whole or not at all
(`staged_folder`); a run's steps table and op records stream into a scratch
folder beside (`run_scratch`) and are copied (the table) or moved (the ops) in
with the rest.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pandas as pd

from kvsim.sim.engine.config import KV_GROUPS_KEY, SimConfig
from kvsim.sim.engine.run import RunResult
from kvsim.sim.engine.step_log import release_arrow_memory
from kvsim.workloads.files import read_json

TABLES = ("steps.parquet", "requests.parquet")
GROUPS = "groups.parquet"  # a run in vLLM's hybrid groups: the blocks each group held after each step


# what a kvsim command writes at the top of an output folder, by name (a run's tables, op records,
# groups and plots; a cluster's and a P/D cluster's tables, plot and replica folders; a curve's): an
# existing folder's entries of these names are an earlier output, replaced whole by the next; nothing
# else there is touched (an `--out .` keeps the folder's own files, whatever their kind)
# (the cluster's, P/D's, plots' and curve's names are their modules', which import this one:
# tests/sim/studies/test_output_folder.py writes each kind of folder and checks every entry is here)
OUTPUTS = frozenset((
    "config.json", "summary.json", *TABLES, GROUPS, "ops.parquet", "op_tokens.parquet",
    "received.parquet", "load.parquet", "paths.parquet", "curve.parquet",
    "blocks.png", "hit_rate.png", "latency.png", "cluster.png", "pd.png", "curve.png",
))
_REPLICA = re.compile(r"replica-\d+")


def owned(name: str) -> bool:
    """Whether an entry named `name` at the top of an output folder is one kvsim writes there."""
    return name in OUTPUTS or _REPLICA.fullmatch(name) is not None


@contextmanager
def staged_folder(out_dir: str | Path) -> Iterator[Path]:
    """A fresh folder beside `out_dir` to write into: when the block ends cleanly its files move
    into `out_dir` (created, with its parents, if missing); when it raises the folder is
    removed, so a failed write never leaves a half-written output folder.

    An existing `out_dir` keeps only what kvsim did not write there (`owned`): an earlier run's
    outputs go first, all of them, so no table, plot or replica folder of that run is left beside the
    new one's (a one-replica run where a cluster ran, a run without `--record-ops` where one had
    them). Should a move fail, what was moved goes back, and the folder is as it was."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name or 'out'}.", suffix=".tmp"))
    try:
        yield tmp
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; results are meant to be shared
        if not out.exists():
            os.replace(tmp, out)
        else:
            _replace_outputs(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _replace_outputs(new: Path, out: Path) -> None:
    """Move `out`'s own entries (`owned`) aside, then `new`'s entries in; on a failed move, undo."""
    old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name or 'out'}.", suffix=".old"))
    gone: list[str] = []
    came: list[str] = []
    try:
        for entry in sorted(out.iterdir()):
            if owned(entry.name):
                os.replace(entry, old / entry.name)
                gone.append(entry.name)
        for entry in sorted(new.iterdir()):
            os.replace(entry, out / entry.name)
            came.append(entry.name)
    except OSError:
        for name in reversed(came):
            os.replace(out / name, new / name)
        for name in reversed(gone):
            os.replace(old / name, out / name)
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def run_scratch(out_dir: str | Path) -> Iterator[Path]:
    """A fresh folder beside `out_dir` for a run to stream its steps table and op records into
    (`simulate`'s `steps_file` and `ops_dir`); `write_run` takes them into the run folder; the
    folder is removed at the end."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name or 'out'}.", suffix=".scratch"))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_run(result: RunResult, out_dir: str | Path, plots: bool = True,
              draw: Callable[[RunResult, Path], object] | None = None) -> Path:
    """Write the run folder (see the module docstring); returns its path. A streamed steps
    table is copied in, and the result reads it from there afterwards. The plots are drawn
    by `draw(result, folder)` if given (`PlotWorkers.draw`), else here."""
    streamed = isinstance(result.steps_table, Path)
    with staged_folder(out_dir) as out:
        cfg = result.config.to_dict()
        if result.manager is not None:  # the resolved size, so a replay needs no cost model
            cfg["num_gpu_blocks"] = result.manager.num_blocks
            if getattr(result.manager, "num_groups", 1) > 1:  # vLLM's hybrid groups: what gpu-replay checks each group by
                cfg[KV_GROUPS_KEY] = [{"kind": g.kind, "window": g.window, "block_size": g.block_size}
                                      for g in result.manager.groups]
        (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        if streamed:
            shutil.copyfile(result.steps_table, out / TABLES[0])
            result.steps_table = out / TABLES[0]
        else:
            result.steps.to_parquet(out / TABLES[0], index=False)
        result.requests.to_parquet(out / TABLES[1], index=False)
        if result.group_usage is not None:
            result.group_usage.to_parquet(out / GROUPS, index=False)
        release_arrow_memory()
        (out / "summary.json").write_text(json.dumps(result.summary, indent=2) + "\n")
        if result.config.record_ops and result.manager is not None:
            result.manager.save_ops(out)
        if plots and draw is not None:
            draw(result, out)
        elif plots:
            from kvsim.sim.studies.plots import write_plots

            write_plots(result, out)
    if streamed:
        result.steps_table = Path(out_dir) / TABLES[0]
    return Path(out_dir)


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON object file; anything else raises ValueError naming the file."""
    data = read_json(path)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def check_run_folder(d: Path) -> None:
    """Raise FileNotFoundError naming `d` unless it holds a run's summary.json: no such path, or a
    path that is no run folder."""
    if not d.exists():
        raise FileNotFoundError(f"{d}: no such run folder")
    if not (d / "summary.json").is_file():
        raise FileNotFoundError(f"{d}: not a run folder (no summary.json)")


def read_summary(run_dir: str | Path) -> dict[str, Any]:
    """A run folder's summary.json (a lone run's or a cluster's); a folder without one, or a bad
    one, raises FileNotFoundError or ValueError naming it."""
    d = Path(run_dir)
    check_run_folder(d)
    return read_json_object(d / "summary.json")


def read_table(path: Path) -> pd.DataFrame:
    """A parquet table; anything else raises ValueError naming the file."""
    try:
        return pd.read_parquet(path)
    except ValueError:  # pyarrow's ArrowInvalid: not parquet, or cut short
        raise ValueError(f"{path}: not a parquet table (corrupt, or another format)") from None


SUMMARY_KEYS = ("requests", "finished", "hit_rate", "num_gpu_blocks", "steps")  # every kvsim summary has these


def load_run(run_dir: str | Path) -> RunResult:
    """Read a run folder back (without the manager); a missing or bad file raises an error
    (FileNotFoundError, ValueError) that names it."""
    d = Path(run_dir)
    check_run_folder(d)
    missing = [n for n in ("config.json", *TABLES) if not (d / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{d}: not a complete run folder (no {missing[0]})")
    cfg = SimConfig.from_run_config(read_json_object(d / "config.json"), source=str(d / "config.json"))
    summary = read_json_object(d / "summary.json")
    lacks = [k for k in SUMMARY_KEYS if k not in summary]
    if lacks:
        raise ValueError(f"{d / 'summary.json'}: not a kvsim summary (no {lacks[0]!r})")
    usage = read_table(d / GROUPS) if (d / GROUPS).is_file() else None
    return RunResult(cfg, summary.get("workload", d.name), read_table(d / TABLES[0]), read_table(d / TABLES[1]),
                     summary, group_usage=usage)
