"""Run one simulation and keep what it produced in a run folder.

A run folder holds `config.json`, `steps.parquet`, `requests.parquet`,
`summary.json`, `ops.parquet` and `op_tokens.parquet` (only with
`record_ops`: what `kvsim gpu-replay` reads) and PNG plots. `config.json`
holds the resolved `num_gpu_blocks`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import simpy

from kvcache.manager import KVCacheManager
from sim.config import SimConfig
from sim.engine import Engine
from sim.metrics import summarize
from workloads.request import Request

if TYPE_CHECKING:
    from sim.cost_model import CostModel


@dataclass
class RunResult:
    """A finished run: its tables, summary, config and (in memory only) the manager."""

    config: SimConfig
    workload: str
    steps: pd.DataFrame
    requests: pd.DataFrame
    summary: dict[str, Any]
    manager: KVCacheManager | None = None


def make_manager(cfg: SimConfig, cost: CostModel) -> KVCacheManager:
    """The block manager `cfg` describes, sized by the cost model."""
    window = cfg.sliding_window if cfg.sliding_window is not None else cost.sliding_window
    return KVCacheManager(
        cost.num_gpu_blocks(cfg),
        cfg.block_size,
        num_cpu_blocks=cfg.num_cpu_blocks,
        enable_caching=cfg.enable_prefix_caching,
        eviction=cfg.eviction,
        watermark=cfg.watermark,
        sliding_window=window,
        record_ops=cfg.record_ops,
        defrag_threshold=cfg.defrag_threshold,
        vllm_version=cfg.vllm_version,
    )


def simulate(
    workload: Iterable[Request],
    cfg: SimConfig,
    progress: Callable[[int], None] | None = None,
    *,
    cost_model: CostModel | None = None,
) -> RunResult:
    """Replay `workload` through the engine `cfg` describes; deterministic for a given
    workload and config. `progress(n)` is called as requests finish;
    `cost_model` defaults to `CostModel.from_config(cfg)`."""
    cfg.validate()
    if cost_model is None:
        from sim.cost_model import CostModel

        cost_model = CostModel.from_config(cfg)
    manager = make_manager(cfg, cost_model)
    env = simpy.Environment()
    engine = Engine(env, workload, cfg, cost_model, manager, progress)
    env.run()
    steps = engine.steps.frame()
    requests = engine.requests.frame()
    counters = {"skipped_lines": getattr(workload, "skipped", 0)}
    summary = summarize(
        steps,
        requests,
        block_size=cfg.block_size,
        num_gpu_blocks=manager.pool.num_blocks,
        slo_ttft=cfg.slo_ttft,
        slo_tpot=cfg.slo_tpot,
        counters=counters,
    )
    name = getattr(workload, "name", "workload")
    summary = {"workload": name, "model": cfg.model, "gpu": cfg.gpu, **summary}
    return RunResult(cfg, name, steps, requests, summary, manager)


def write_run(result: RunResult, out_dir: str | Path, plots: bool = True) -> Path:
    """Write the run folder (see the module docstring); returns its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = result.config.to_dict()
    if result.manager is not None:  # the resolved size, so a replay needs no cost model
        cfg["num_gpu_blocks"] = result.manager.pool.num_blocks
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    result.steps.to_parquet(out / "steps.parquet", index=False)
    result.requests.to_parquet(out / "requests.parquet", index=False)
    (out / "summary.json").write_text(json.dumps(result.summary, indent=2) + "\n")
    if result.config.record_ops and result.manager is not None:
        result.manager.ops.save(out)
    if plots:
        from sim.plots import write_plots

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
