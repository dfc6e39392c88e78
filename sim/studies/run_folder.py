"""The run folder: what one simulation leaves on disk, and reading it back.

A run folder holds `config.json`, `steps.parquet`, `requests.parquet`,
`summary.json`, `ops.parquet` and `op_tokens.parquet` (only with
`record_ops`: what `kvsim gpu-replay` reads) and PNG plots. `config.json`
holds the resolved `num_gpu_blocks`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from sim.engine.config import SimConfig
from sim.engine.run import RunResult


def write_run(result: RunResult, out_dir: str | Path, plots: bool = True) -> Path:
    """Write the run folder (see the module docstring); returns its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = result.config.to_dict()
    if result.manager is not None:  # the resolved size, so a replay needs no cost model
        cfg["num_gpu_blocks"] = result.manager.num_blocks
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    result.steps.to_parquet(out / "steps.parquet", index=False)
    result.requests.to_parquet(out / "requests.parquet", index=False)
    (out / "summary.json").write_text(json.dumps(result.summary, indent=2) + "\n")
    if result.config.record_ops and result.manager is not None:
        result.manager.save_ops(out)
    if plots:
        from sim.studies.plots import write_plots

        write_plots(result, out)
    return out


def load_run(run_dir: str | Path) -> RunResult:
    """Read a run folder back (without the manager)."""
    d = Path(run_dir)
    if not (d / "summary.json").is_file():
        raise FileNotFoundError(f"{d}: not a run folder (no summary.json)")
    cfg = SimConfig.from_dict(json.loads((d / "config.json").read_text()), source=str(d / "config.json"))
    summary = json.loads((d / "summary.json").read_text())
    return RunResult(
        cfg,
        summary.get("workload", d.name),
        pd.read_parquet(d / "steps.parquet"),
        pd.read_parquet(d / "requests.parquet"),
        summary,
    )
