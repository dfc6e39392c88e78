"""Run one simulation: build the block manager and engine a config describes, replay a
workload through them and summarize what happened (`sim.studies.run_folder` keeps it)."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import simpy

from kvsim.kvcache.events import EventBatch
from kvsim.kvcache.hybrid import HybridKVCacheManager
from kvsim.kvcache.manager import KVCacheManager
from kvsim.sim.engine.config import ConfigError, SimConfig
from kvsim.sim.engine.loop import Engine
from kvsim.sim.engine.metrics import summarize
from kvsim.sim.engine.step_log import StepFile
from kvsim.workloads.request import Request

if TYPE_CHECKING:
    from kvsim.sim.engine.cost_model import CostModel


@dataclass
class RunResult:
    """A finished run: its tables, summary, config and (in memory only) the manager.

    The steps table may live in a parquet file (a streamed run, see `simulate`): `steps`
    reads it whole on first use, `step_columns` only the columns asked for.
    """

    config: SimConfig
    workload: str
    steps_table: pd.DataFrame | Path
    requests: pd.DataFrame
    summary: dict[str, Any]
    manager: KVCacheManager | None = None
    # vLLM's hybrid groups: the blocks each group holds after each step, a row a step (`held_<g>`)
    group_usage: pd.DataFrame | None = None
    # vLLM's KV events (`SimConfig.kv_events`), a batch a step that queued any, unless handed to a sink
    kv_events: list[EventBatch] | None = None

    @property
    def steps(self) -> pd.DataFrame:
        if isinstance(self.steps_table, Path):
            self.steps_table = pd.read_parquet(self.steps_table)
        return self.steps_table

    def step_columns(self, *names: str, every: int = 1) -> pd.DataFrame:
        """These columns of the steps table (every `every`-th row), without reading the others
        from a streamed run's file."""
        if isinstance(self.steps_table, Path):
            return StepFile(self.steps_table).frame(*names, every=every)
        return self.steps_table[list(names)].iloc[::every]

    @property
    def num_steps(self) -> int:
        return len(StepFile(self.steps_table)) if isinstance(self.steps_table, Path) else len(self.steps_table)


def make_manager(cfg: SimConfig, cost: CostModel) -> KVCacheManager | HybridKVCacheManager:
    """The block manager `cfg` describes, sized by the cost model: vLLM's hybrid KV-cache groups
    over one pool where the cost model lays the model out in several (`CostModel.layout`)."""
    if getattr(cost, "layout", None) is not None:  # (a stand-in cost model has none)
        return make_hybrid_manager(cfg, cost)
    window = cfg.sliding_window if cfg.sliding_window is not None else cost.sliding_window
    if window is None and cfg.prefix_cache_retention_interval:  # vLLM refuses it (kv_cache_coordinator.py)
        raise ConfigError(f"prefix_cache_retention_interval {cfg.prefix_cache_retention_interval}: {cfg.model}'s cache "
                          "has no sliding-window group, so retention has no effect (vLLM refuses it); set 0 or none")
    m = KVCacheManager(
        cost.num_gpu_blocks(cfg),
        cfg.block_size,
        num_cpu_blocks=cfg.num_cpu_blocks,
        enable_caching=cfg.enable_prefix_caching,
        eviction=cfg.eviction,
        watermark=cfg.watermark,
        sliding_window=window,
        prefix_cache_retention_interval=cfg.prefix_cache_retention_interval,
        record_ops=cfg.record_ops,
        defrag_threshold=cfg.defrag_threshold,
        vllm_version=cfg.vllm_version,
        kv_events=cfg.kv_events,
    )
    if window is not None:  # vLLM's admission cap: the window and a step's tokens a batch in flight (two under async)
        in_flight = window - 1 + cfg.batch_limits()[0] * (2 if cfg.runs_async else 1)
        m.admission_tokens = in_flight if cfg.max_model_len is None else min(in_flight, cfg.max_model_len)
    return m


HYBRID_REFUSES = (("num_cpu_blocks", "swap space"), ("defrag_threshold", "defragmentation"),
                  # vLLM 0.33's OffloadingConnector supports the hybrid manager (SupportsHMA,
                  # offloading_connector.py), so vLLM keeps the groups with it on; kvsim not yet
                  ("kv_offloading_size", "KV offloading (vLLM's OffloadingConnector offloads each group)"))


def make_hybrid_manager(cfg: SimConfig, cost: CostModel) -> HybridKVCacheManager:
    """vLLM's hybrid manager for the cost model's groups (`sim.engine.layers.hybrid_layout`); what
    kvsim models only for one group is refused with the way to run the model without groups."""
    layout = cost.layout
    if cfg.prefix_cache_retention_interval and not any(g.layer.kind in ("sliding_window", "mamba")
                                                       for g in layout.groups):
        raise ConfigError(f"prefix_cache_retention_interval {cfg.prefix_cache_retention_interval}: {cfg.model}'s cache "
                          "has no sliding-window or Mamba group, so retention has no effect (vLLM refuses it); set 0 "
                          "or none")
    if layout.has_mamba and cfg.enable_prefix_caching and not cfg.enable_chunked_prefill:
        raise ConfigError(f"enable_chunked_prefill false: vLLM runs {cfg.model}'s Mamba state with prefix caching only "
                          "with chunked prefill (model_executor/models/config.py asserts it)")
    if layout.has_mamba and not cfg.enable_prefix_caching:
        raise ConfigError(f"enable_prefix_caching false: {cfg.model}'s Mamba state without prefix caching is vLLM's "
                          "'none' cache mode (one state block a request), which kvsim does not model; kvsim models "
                          "the 'align' mode vLLM runs with prefix caching on")
    for field, what in HYBRID_REFUSES:
        if getattr(cfg, field):
            raise ConfigError(f"{field}: {what} is not modelled with vLLM's hybrid KV-cache groups ({cfg.model} "
                              f"keeps {len(cost.layout.groups)}); set disable_hybrid_kv_cache_manager "
                              "(--disable-hybrid-kv-cache-manager) to run it with one group")
    if cfg.parallel_sampling == "fork" or cfg.preemption == "swap":
        raise ConfigError("vLLM's hybrid KV-cache groups run V1's scheduler: parallel_sampling 'fanout' and "
                          "preemption 'recompute' only")
    return HybridKVCacheManager(
        cost.num_gpu_blocks(cfg),
        [g.spec(cost.block_size) for g in layout.groups],
        enable_caching=cfg.enable_prefix_caching,
        eviction=cfg.eviction,
        watermark=cfg.watermark,
        prefix_cache_retention_interval=cfg.prefix_cache_retention_interval,
        # vLLM's `VllmConfig.max_in_flight_tokens`: a step's budget for each batch in flight (two under async)
        in_flight_tokens=cfg.batch_limits()[0] * (2 if cfg.runs_async else 1),
        max_model_len=cfg.max_model_len,
        mamba_checkpoint_alignment=layout.checkpoint_alignment,
        record_ops=cfg.record_ops,
        vllm_version=cfg.vllm_version,
        kv_events=cfg.kv_events,
    )


def replay_manager(cfg: SimConfig, num_blocks: int) -> KVCacheManager | HybridKVCacheManager:
    """The block manager a cache-only replay of `cfg`'s model runs over `num_blocks` blocks (vLLM's
    count, null block included): vLLM's hybrid KV-cache groups where `kvsim run` keeps the model in
    them (`CostModel.layout`, with its block size), else one group of `cfg.block_size`."""
    from kvsim.sim.engine.cost_model import CostModel

    cfg = cfg.replace(num_gpu_blocks=num_blocks).validate()
    cost = CostModel.from_config(cfg)
    if cost.layout is not None:
        return make_hybrid_manager(cfg, cost)
    return KVCacheManager(num_blocks, cfg.block_size, eviction=cfg.eviction, track_ids=False,
                          vllm_version=cfg.vllm_version)


@contextmanager
def rare_collections(every: int = 100_000) -> Iterator[None]:
    """Run the cyclic garbage collector's youngest pass every `every` container allocations, not
    700: a run makes millions of short-lived tuples and lists that die by reference count, and
    scanning them for cycles cost 0.15-0.2 s of the Azure run's ~4 s (a run makes almost no
    cycles: ~900 objects there). The old threshold is restored after."""
    old = gc.get_threshold()
    gc.set_threshold(every, *old[1:])
    try:
        yield
    finally:
        gc.set_threshold(*old)


def simulate(
    workload: Iterable[Request],
    cfg: SimConfig,
    progress: Callable[[int], None] | None = None,
    *,
    cost_model: CostModel | None = None,
    ops_dir: str | Path | None = None,
    steps_file: str | Path | None = None,
    kv_events: Callable[[EventBatch], None] | None = None,
) -> RunResult:
    """Replay `workload` through the engine `cfg` describes; deterministic for a given
    workload and config. `progress(n)` is called as requests finish;
    `cost_model` defaults to `CostModel.from_config(cfg)`. With `record_ops`, the op
    stream is kept in memory, or written into `ops_dir` as it goes (`OpLog.stream_to`).
    With `steps_file`, the steps table is written there as it goes (a parquet file), so
    memory does not grow with the run's steps; the result reads it back on demand. With
    `cfg.kv_events`, each step's KV events are handed to `kv_events` as an `EventBatch`, or kept
    in the result's `kv_events` (no sink given)."""
    cfg.validate()
    if cfg.replicas > 1:
        raise ConfigError(f"replicas {cfg.replicas}: a cluster runs through sim.cluster.run.simulate_cluster "
                          "(kvsim run --replicas, kvsim.simulate_cluster)")
    if cost_model is None:
        from kvsim.sim.engine.cost_model import CostModel

        cost_model = CostModel.from_config(cfg)
    manager = make_manager(cfg, cost_model)
    if cfg.record_ops and ops_dir is not None:
        manager.stream_ops(ops_dir, process=True)
    env = simpy.Environment()
    batches: list[EventBatch] | None = [] if cfg.kv_events and kv_events is None else None
    sink = batches.append if batches is not None else kv_events
    requests = workload
    if cfg.kv_transfer_role == "prefill":  # the proxy asks the prefill side for one token
        from kvsim.sim.engine.nixl import prefill_backoff, with_max_tokens_one

        backoff = prefill_backoff(cost_model)
        requests = (with_max_tokens_one(req, backoff) for req in workload)
    engine = Engine(env, requests, cfg, cost_model, manager, progress, steps_file=steps_file, kv_events=sink)
    with rare_collections():
        env.run()
    if cfg.record_ops and ops_dir is not None:
        manager.finish_ops()  # the writer encodes the last ops while the tables below are made
    return engine_result(engine, cfg, cost_model, getattr(workload, "name", "workload"),
                         getattr(workload, "skipped", 0), steps_file, batches)


def engine_result(engine: Engine, cfg: SimConfig, cost_model: CostModel, name: str, skipped: int,
                  steps_file: str | Path | None = None, batches: list[EventBatch] | None = None) -> RunResult:
    """A finished engine's tables and summary (`simulate`'s result; a cluster's per replica):
    `name` is the workload's, `skipped` its bad lines skipped, `batches` its KV events kept."""
    manager = engine.m
    if steps_file is None:
        steps = engine.steps.frame()
    else:
        engine.steps.close()
        steps = StepFile(steps_file)
    requests = engine.requests.frame()
    counters = {"skipped_lines": skipped}
    connector = engine.sched.connector  # KV offloading's, the NIXL connector, or None
    if connector is not None:
        counters.update(connector.totals())
    summary = summarize(
        steps,
        requests,
        block_size=manager.block_size,
        num_gpu_blocks=manager.num_blocks,
        slo_ttft=cfg.slo_ttft,
        slo_tpot=cfg.slo_tpot,
        counters=counters,
        fanned_out=cfg.parallel_sampling == "fanout",
    )
    if cfg.kv_offloading_size is not None:  # GPU and tier hits at first admissions, over their prompt tokens
        prompt = summary["prompt_tokens"]
        summary["total_hit_rate"] = (summary["hit_tokens"] + summary["offload_hit_tokens"]) / prompt if prompt else 0.0
    summary = {"workload": name, "model": cfg.model, "gpu": cfg.gpu, **summary}
    layers = getattr(cost_model, "layers", None)  # what the cache holds a layer (a stand-in cost model: none)
    if layers is not None:
        from kvsim.sim.engine.layers import describe_layers

        placement, layout = cost_model.placement, cost_model.layout
        summary.update(kv_layers=describe_layers(layers), kv_bytes_per_block=cost_model.kv_bytes_per_block,
                       cache_approximation=placement.approximation if placement is not None else None,
                       kv_cache_groups=None)
        if layout is not None:  # each group: its layout and what it did
            summary["kv_cache_groups"] = [{**row, **metrics} for row, metrics in
                                          zip(layout.table(cfg.block_size), manager.group_metrics(), strict=True)]
    usage = engine.group_usage.frame() if engine.group_usage is not None else None
    return RunResult(cfg, name, steps if steps_file is None else steps.path, requests, summary, manager, usage,
                     batches)
