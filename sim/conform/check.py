"""Conformance with vLLM: the same workload through kvsim and through vLLM's own classes, diffed.

Two modes. `manager`: the cache-replay loop (`kvcache.replay`) over kvsim's
KVCacheManager and over vLLM's real KVCacheManager; per request, the hit
tokens, output tokens, status and preemptions must agree. `scheduler`: a
step-time run of kvsim's engine against vLLM's real Scheduler with a fake
model runner (`sim.conform.vllm_scheduler`; when `SimConfig.runs_async`, vLLM's
AsyncScheduler behind EngineCore's batch queue; with `SimConfig.kv_offloading_size`, vLLM's
OffloadingConnector with a fake worker timed as kvsim's, `sim.conform.vllm_offload`); per
request, the steps that first scheduled it, sampled its first token and finished it, its
preemptions and its hit tokens must agree. vLLM is imported only by `sim.conform.vllm_cache`,
`sim.conform.vllm_scheduler` and `sim.conform.vllm_offload`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvsim.sim.conform.vllm_setup import PrefixName
from kvsim.sim.engine.config import SCHEDULER_KNOBS, ConfigError, SimConfig

MANAGER_FIELDS = ("hit_tokens", "output_tokens", "status", "preemptions")
SCHEDULER_FIELDS = ("first_scheduled_step", "first_token_step", "finish_step", "preemptions", "hit_tokens")
MODES = ("manager", "scheduler", "both", "events")
MANAGER_NO_OFFLOADING = ("manager mode replays the cache without a scheduler and does not cover KV "
                         "offloading; use --mode scheduler")
MANAGER_NO_SAMPLES = ("manager mode drives one sequence per request and does not cover parallel sampling "
                      "(n > 1); use --mode scheduler")


@dataclass
class Diff:
    """How one mode's per-request records compare."""

    mode: str
    requests: int
    differing: int
    first: tuple[str, str, Any, Any] | None = None  # (request id, field, kvsim, vllm)
    total: tuple[str, Any, Any] | None = None  # a whole-run figure that differs: (name, kvsim, vllm)
    unit: str = "request"  # what `requests` counts and `first` names (the events mode: steps)

    @property
    def ok(self) -> bool:
        return self.differing == 0 and self.total is None

    def format(self) -> str:
        head = f"{self.mode:<9} {self.requests:,} {self.unit}s, {self.differing:,} differ"
        if self.first is not None:
            rid, field, ours, theirs = self.first
            head = f"{head}; first: {self.unit} {rid!r} {field}: kvsim {ours!r}, vLLM {theirs!r}"
        if self.total is not None:
            name, ours, theirs = self.total
            head = f"{head}; total {name}: kvsim {ours!r}, vLLM {theirs!r}"
        return head


def compare(mode: str, ours: Sequence[dict], theirs: Sequence[dict], fields: Sequence[str]) -> Diff:
    """Match records by request id; a request missing on one side differs in its 'presence'."""
    a = {r["id"]: r for r in ours}
    b = {r["id"]: r for r in theirs}
    order = [r["id"] for r in ours] + [r["id"] for r in theirs if r["id"] not in a]
    differing, first = 0, None
    for rid in order:
        if rid not in a or rid not in b:
            bad = ("presence", rid in a, rid in b)
        else:
            bad = next(((f, a[rid][f], b[rid][f]) for f in fields if a[rid][f] != b[rid][f]), None)
        if bad is not None:
            differing += 1
            if first is None:
                first = (rid, *bad)
    return Diff(mode, len(order), differing, first)


def kvsim_manager(requests: list, *, block_size: int, num_blocks: int, max_running: int,
                  enable_caching: bool, vllm_version: str, sliding_window: int | None = None,
                  prefix_cache_retention_interval: int | None = 0, layers: Any = None,
                  mamba_checkpoints: bool = False) -> list[dict]:
    """kvsim's cache replay, one record per request as `kvsim cache-replay --out` writes it;
    `layers`: a model's layers mixing kinds, in vLLM's hybrid KV-cache groups (`mamba_checkpoints`:
    its Mamba-state layers export prefill checkpoints)."""
    from kvsim.kvcache.hybrid import HybridKVCacheManager
    from kvsim.kvcache.manager import KVCacheManager
    from kvsim.kvcache.replay import replay
    from kvsim.sim.engine.layers import hybrid_layout

    if layers is not None:
        m = HybridKVCacheManager(num_blocks, [g.spec(block_size) for g in hybrid_layout(layers).groups],
                                 enable_caching=enable_caching, track_ids=False, vllm_version=vllm_version,
                                 prefix_cache_retention_interval=prefix_cache_retention_interval,
                                 mamba_checkpoint_alignment=block_size if mamba_checkpoints else None)
    else:
        m = KVCacheManager(num_blocks, block_size, enable_caching=enable_caching, track_ids=False,
                           vllm_version=vllm_version, sliding_window=sliding_window,
                           prefix_cache_retention_interval=prefix_cache_retention_interval)
    out: list[dict] = []
    replay(requests, m, max_running, lambda rec: out.append({
        "id": rec.id, "prompt_tokens": rec.prompt_tokens, "hit_tokens": rec.hit_tokens,
        "output_tokens": rec.output_tokens, "status": rec.status, "preemptions": rec.preemptions,
    }))
    return out


def kvsim_scheduler(requests: list, cfg: SimConfig) -> list[dict]:
    """kvsim's engine in step-time mode, one record per request (SCHEDULER_FIELDS)."""
    return simulate_scheduler(requests, cfg)[0]


def simulate_scheduler(requests: list, cfg: SimConfig) -> tuple[list[dict], dict[str, Any]]:
    """kvsim's engine in step-time mode: one record per request (SCHEDULER_FIELDS), and the summary."""
    from kvsim.sim.engine.run import simulate

    result = simulate(requests, cfg)
    rq = result.requests
    dropped = rq[rq["status"] != "finished"]
    if len(dropped):
        r = dropped.iloc[0]
        if r["reason"] == "prompt_exceeds_max_model_len":
            n = int((dropped["reason"] == r["reason"]).sum())
            raise ConfigError(
                f"{n} requests leave no token under max_model_len {cfg.max_model_len} (first: "
                f"{r['id']!r}, a {int(r['prompt_tokens'])}-token prompt); vLLM refuses them before it "
                "schedules: give a larger --max-model-len or leave them out")
        raise ConfigError(
            f"{len(dropped)} requests do not fit (first: {r['id']!r}, {r['reason']}); vLLM would "
            "stall on them: give more --num-gpu-blocks or a larger --max-num-batched-tokens"
        )
    return [
        {"id": r.id, **{f: int(getattr(r, f)) for f in SCHEDULER_FIELDS}}
        for r in rq.itertuples()
    ], result.summary


def check_workload(requests: list) -> None:
    """What the vLLM side cannot take: empty prompts."""
    for r in requests:
        if r.prompt_len < 1:
            raise ConfigError(f"request {r.id!r}: empty prompt")


def fanned_out(requests: list) -> list:
    """The workload as vLLM's scheduler sees it: each request with n > 1 as its n requests."""
    from kvsim.sim.engine.scheduler import fan_out

    return [sample for r in requests for sample in fan_out(r)]


def by_request(requests: list, records: list[dict]) -> list[dict]:
    """vLLM's per-sample records folded into one a request, as kvsim's log keeps them: the first
    scheduling and first token of any sample, the finish of the last, preemptions and hits summed."""
    from kvsim.sim.engine.scheduler import fan_out

    recs = {r["id"]: r for r in records}
    out = []
    for q in requests:
        kids = [recs[sample.id] for sample in fan_out(q)]
        out.append({"id": q.id, **{f: min(k[f] for k in kids) for f in ("first_scheduled_step", "first_token_step")},
                    "finish_step": max(k["finish_step"] for k in kids),
                    **{f: sum(k[f] for k in kids) for f in ("preemptions", "hit_tokens")}})
    return out


def run_manager(requests: list, *, block_size: int, num_blocks: int, max_running: int,
                enable_caching: bool, vllm_version: str, sliding_window: int | None = None,
                prefix_cache_retention_interval: int | None = 0, layers: Any = None,
                mamba_checkpoints: bool = False) -> Diff:
    from kvsim.sim.conform import vllm_cache

    windowed = sliding_window is not None or layers is not None
    kw = {"block_size": block_size, "num_blocks": num_blocks, "max_running": max_running,
          "enable_caching": enable_caching, "sliding_window": sliding_window, "layers": layers,
          "mamba_checkpoints": mamba_checkpoints,
          "prefix_cache_retention_interval": prefix_cache_retention_interval if windowed else 0}
    ours = kvsim_manager(requests, vllm_version=vllm_version, **kw)
    theirs = vllm_cache.replay_manager(requests, **kw)
    return compare("manager", ours, theirs, MANAGER_FIELDS)


def run_scheduler(requests: list, cfg: SimConfig) -> Diff:
    """kvsim's engine against vLLM's Scheduler (with its OffloadingConnector when `cfg` offloads)."""
    if cfg.kv_offloading_size is not None:
        return run_offload_scheduler(requests, cfg)
    if cfg.step_time is None:
        from kvsim.sim.conform.vllm_nixl import Nixl
        from kvsim.sim.conform.vllm_timed import run_timed
        from kvsim.sim.engine.cost_model import CostModel
        from kvsim.sim.engine.nixl import BlockBytes

        args = _scheduler_args(cfg)
        del args["step_time"]
        nixl = Nixl.from_config(cfg, BlockBytes.of(CostModel.from_config(cfg)))  # P/D's connector, or None

        def vllm_side() -> list[dict]:
            return run_timed(requests, **args, step_seconds=step_seconds(cfg), async_scheduling=vllm_async(cfg),
                             load=cfg.load, closed_loop=cfg.closed_loop_sessions, nixl=nixl)
    else:
        from kvsim.sim.conform.vllm_scheduler import run_scheduler as vllm_run_scheduler

        def vllm_side() -> list[dict]:
            return vllm_run_scheduler(fanned_out(requests), **_scheduler_args(cfg),
                                      async_scheduling=vllm_async(cfg))
    ours = _both_or_neither_stall(lambda: kvsim_scheduler(requests, cfg), vllm_side)
    return compare("scheduler", ours, by_request(requests, vllm_side()), SCHEDULER_FIELDS)


def step_seconds(cfg: SimConfig) -> Callable[[int, int, int, int, list[tuple[int, int]]], float]:
    """kvsim's cost model for `cfg` as the cost-clock driver asks it: a batch's (prefill, decode and
    context tokens, sequences, prefill chunks) to seconds, with no charged block ops (vLLM V1 copies
    and swaps none)."""
    from kvsim.kvcache.ops import CHARGED_KINDS
    from kvsim.sim.engine.cost_model import CostModel

    cost, none = CostModel.from_config(cfg), dict.fromkeys(CHARGED_KINDS, 0)
    return lambda prefill, decode, context, seqs, chunks: cost.step_time(prefill, decode, context, seqs, none, chunks)


def vllm_async(cfg: SimConfig) -> bool | None:
    """What vLLM's `SchedulerConfig.async_scheduling` is given: None where kvsim resolves its own None
    to async (`SimConfig.runs_async`), so that `VllmConfig` resolves it as `vllm serve` does (and the
    driver fails if vLLM says sync); else kvsim's mode, as a flag (a sync one where kvsim models only
    sync, e.g. another release's rules)."""
    return None if cfg.async_scheduling is None and cfg.runs_async else cfg.runs_async


def _scheduler_args(cfg: SimConfig) -> dict[str, Any]:
    """The vLLM scheduler drivers' arguments for `cfg`."""
    from kvsim.sim.engine.cost_model import CostModel

    tokens, seqs = cfg.batch_limits()
    cost = CostModel.from_config(cfg)
    window = cost.sliding_window  # cfg's, or the model's
    layers = hybrid_layers(cost)
    windowed = window is not None or layers is not None
    return {"block_size": cost.block_size, "num_gpu_blocks": cost.num_gpu_blocks(cfg), "sliding_window": window,
            "layers": layers, "mamba_checkpoints": mamba_checkpoints(cost),
            "prefix_cache_retention_interval": cfg.prefix_cache_retention_interval if windowed else 0,
            "max_num_batched_tokens": tokens, "max_num_seqs": seqs,
            "enable_chunked_prefill": cfg.enable_chunked_prefill, "enable_prefix_caching": cfg.enable_prefix_caching,
            "long_prefill_token_threshold": cfg.long_prefill_token_threshold, "watermark": cfg.watermark,
            "step_time": cfg.step_time, "scheduling": cfg.scheduling, "max_model_len": cfg.max_model_len,
            "scheduler_extra": scheduler_extra(cfg)}


def hybrid_layers(cost: Any) -> Any:
    """The model's layers when kvsim keeps them in vLLM's hybrid KV-cache groups, else None."""
    return cost.layers if cost.layout is not None else None


def mamba_checkpoints(cost: Any) -> bool:
    """Whether the model's Mamba-state layers export prefill checkpoints (`CostModel.layout`)."""
    return cost.layout is not None and cost.layout.checkpoint_alignment is not None


def scheduler_extra(cfg: SimConfig) -> dict[str, Any]:
    """vLLM SchedulerConfig fields for `cfg`'s SCHEDULER_KNOBS, those not at vLLM's defaults."""
    default = SimConfig()
    return {k: getattr(cfg, k) for k in SCHEDULER_KNOBS if getattr(cfg, k) != getattr(default, k)}


def _offload_args(cfg: SimConfig, args: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """kvsim's host tier and link as vLLM's offloading driver takes them (`vllm_offload.Offloading`),
    and the scheduler `args` without the knobs offloading does not take (full attention only)."""
    from kvsim.kvcache.offload.size import num_host_chunks
    from kvsim.sim.conform.vllm_offload import Offloading
    from kvsim.sim.engine.cost_model import CostModel

    cost = CostModel.from_config(cfg)
    chunks = num_host_chunks(cfg.kv_offloading_size, cost.kv_bytes_per_block, cfg.tensor_parallel,
                             cfg.offload_blocks_per_chunk)
    off = Offloading(chunks, cfg.offload_eviction_policy, cfg.offload_store_threshold, cfg.offload_blocks_per_chunk,
                     cfg.offload_prompt_only, (cost.op_cost_s["load"], cost.op_cost_s["store"]))
    dropped = ("sliding_window", "prefix_cache_retention_interval", "layers", "mamba_checkpoints")
    return off, {k: v for k, v in args.items() if k not in dropped}


def run_offload_scheduler(requests: list, cfg: SimConfig) -> Diff:
    """The scheduler mode with KV offloading: kvsim's engine against vLLM's Scheduler and its
    OffloadingConnector, whose worker is faked with kvsim's transfer timing. Besides the
    per-request fields, the tokens loaded from the tier at first admissions must agree in total
    (kvsim's request log does not keep them per request)."""
    from kvsim.sim.conform.vllm_offload import run_offload_scheduler as vllm_run_offload

    off, args = _offload_args(cfg, _scheduler_args(cfg))
    chunks = off.num_chunks
    if cfg.step_time is None:  # the cost clock
        from kvsim.sim.conform.vllm_timed import run_timed

        del args["step_time"]

        def vllm_side() -> list[dict]:
            return run_timed(requests, **args, offloading=off, step_seconds=step_seconds(cfg),
                             async_scheduling=vllm_async(cfg), load=cfg.load, closed_loop=cfg.closed_loop_sessions)
    else:
        def vllm_side() -> list[dict]:
            return vllm_run_offload(fanned_out(requests), offloading=off, **args, async_scheduling=vllm_async(cfg))
    ours, summary = _both_or_neither_stall(lambda: simulate_scheduler(requests, cfg), vllm_side)
    if summary["host_chunks"] != chunks:
        raise RuntimeError(f"kvsim's tier has {summary['host_chunks']} chunks, conform computed {chunks}")
    theirs = vllm_side()
    diff = compare("scheduler", ours, by_request(requests, theirs), SCHEDULER_FIELDS)
    loaded = (int(summary["offload_hit_tokens"]), sum(r["offload_hit_tokens"] for r in theirs))
    if loaded[0] != loaded[1]:
        diff.total = ("offload_hit_tokens", *loaded)
    return diff


def check_events_case(cfg: SimConfig, requests: list) -> None:
    """Raise ConfigError where the events mode cannot compare (before anything runs): it drives
    vLLM's scheduler on the step grid, with prefix caching on, one sample a request."""
    if cfg.step_time is None or not cfg.enable_prefix_caching:
        raise ConfigError("KV events are compared on the step grid (--step-time), with prefix caching on")
    if any(r.n > 1 for r in requests):
        raise ConfigError("KV events are compared for requests of one sample (n = 1)")


def compare_events(requests: list, cfg: SimConfig) -> Diff:
    """kvsim's KV events against vLLM's, step by step (the step-grid scheduler driver, sync or async, with
    `--kv-events-config` on; a batch is named by the step it was scheduled for; with KV offloading, its driver with the OffloadingConnector, whose CPU
    tier's events follow the GPU pool's in each batch): each step's events must agree in kind, order,
    medium, group, block size, token ids, and hashes named by the prefix they end (the two hash
    functions differ), except that a run of the CPU tier's stored events is compared in a canonical
    order (`_canonical`). A step counts once however many of its events differ; `first` names its
    first differing event."""
    from kvsim.kvcache.sequence import Sequence
    from kvsim.sim.conform.vllm_scheduler import run_scheduler as vllm_run_scheduler
    from kvsim.sim.conform.vllm_setup import prefix_names, token_ids
    from kvsim.sim.engine.run import simulate

    check_events_case(cfg, requests)
    check_workload(requests)
    args = _scheduler_args(cfg)
    bs = args["block_size"]
    names: dict[int, PrefixName] = {}  # kvsim's key -> the name of the prefix its block ends (uids in workload order)
    for uid, r in enumerate(requests):
        toks = token_ids(r, uid)
        keys = Sequence(r.id, r.prompt, uid=uid, output=r.output).hashes_upto(len(toks), bs)
        names.update(zip(keys, prefix_names(toks, bs), strict=True))
    ours: dict[int, list[dict]] = {}
    for batch in simulate(requests, cfg.replace(kv_events=True)).kv_events:
        ours.setdefault(batch.step, []).extend(_named(e.as_dict(), names) for e in batch.events)
    published: list[tuple[int, list[dict]]] = []
    if cfg.kv_offloading_size is not None:
        from kvsim.sim.conform.vllm_offload import run_offload_scheduler as vllm_run_offload

        off, args = _offload_args(cfg, args)
        vllm_run_offload(requests, offloading=off, **args, async_scheduling=vllm_async(cfg), kv_events=published)
    else:
        vllm_run_scheduler(requests, **args, async_scheduling=vllm_async(cfg), kv_events=published)
    theirs: dict[int, list[dict]] = {}
    for step, events in published:
        theirs.setdefault(step, []).extend(events)
    steps = sorted(set(ours) | set(theirs))
    differing, first = 0, None
    for step in steps:
        a, b = _canonical(ours.get(step, [])), _canonical(theirs.get(step, []))
        if a == b:
            continue
        differing += 1
        if first is None:
            i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            first = (step, f"event {i}", _shown(a[i]) if i < len(a) else None, _shown(b[i]) if i < len(b) else None)
    return Diff("events", len(steps), differing, first, unit="step")


def _canonical(events: list[dict]) -> list[dict]:
    """`events` with each run of consecutive CPU-tier `BlockStored`s sorted by hash: vLLM completes a
    store job's chunks in the order of a set of bytes (offloading/scheduler.py `_build_store_jobs`:
    `keys=set(keys_to_store)`, handed to `CPUOffloadingManager.complete_store`), which follows
    PYTHONHASHSEED, so only the run's contents are vLLM's to compare."""
    out: list[dict] = []
    run: list[dict] = []
    for e in [*events, None]:
        if e is not None and e["type"] == "BlockStored" and e["medium"] == "CPU":
            run.append(e)
            continue
        out += sorted(run, key=repr)
        run = []
        if e is not None:
            out.append(e)
    return out


def _named(event: dict, names: dict[int, PrefixName]) -> dict:
    """A kvsim event (`as_dict`) with each hash replaced by the name of the prefix it ends."""
    out = {**event}
    if "block_hashes" in out:
        out["block_hashes"] = [names.get(h, h) for h in out["block_hashes"]]
    if out.get("parent_block_hash") is not None:
        out["parent_block_hash"] = names.get(out["parent_block_hash"], out["parent_block_hash"])
    return out


def _shown(event: dict) -> dict:
    """An event for a diff line: a named hash as the length of its prefix, token ids by count."""
    def short(h: Any) -> Any:
        return f"<{h[0]} tokens>" if isinstance(h, tuple) else h

    out = {**event}
    if "block_hashes" in out:
        out["block_hashes"] = [short(h) for h in out["block_hashes"]]
    if "parent_block_hash" in out:
        out["parent_block_hash"] = short(out["parent_block_hash"])
    if "token_ids" in out:
        out["token_ids"] = f"<{len(out['token_ids'])} ids from {out['token_ids'][:1]}>"
    return out


def _both_or_neither_stall(ours: Callable[[], Any], theirs: Callable[[], Any]) -> Any:
    """`ours()`, kvsim's run; if kvsim's engine stalls (it made no progress for its stall limit of
    batches, or its requests preempt each other in a cycle: `sim.engine.loop.Stalled`), vLLM's run
    too: a case on which both stall or cycle is refused (ConfigError), as one vLLM stalls on alone is;
    a stall of kvsim's alone is kvsim's error."""
    try:
        return ours()
    except RuntimeError as e:
        if "made no progress" not in str(e):
            raise
        try:
            theirs()
        except RuntimeError as v:
            if "scheduled nothing" in str(v) or str(v).startswith("vLLM cycled"):
                raise ConfigError(f"kvsim and vLLM both stall on this case (kvsim: {e}; vLLM: {v})") from None
            raise
        raise


def conform(requests: list, cfg: SimConfig, mode: str = "both", max_running: int = 1,
            on_diff: Callable[[Diff], None] | None = None,
            on_start: Callable[[str], None] | None = None) -> list[Diff]:
    """Run the chosen modes; `cfg` must have a step time and give the block count. With KV
    offloading or parallel sampling only the scheduler mode runs ("both" skips the manager mode).
    "events": the KV-event streams instead (`compare_events`)."""
    if mode not in MODES:
        raise ConfigError(f"--mode must be one of {', '.join(MODES)}, got {mode!r}")
    check_workload(requests)
    offloading = cfg.kv_offloading_size is not None
    samples = any(r.n > 1 for r in requests)
    if offloading and mode == "manager":
        raise ConfigError(MANAGER_NO_OFFLOADING)
    if samples and mode == "manager":
        raise ConfigError(MANAGER_NO_SAMPLES)
    if cfg.kv_transfer_role is not None and (mode == "manager" or cfg.step_time is not None):
        raise ConfigError("kv_transfer_role is conformed in the scheduler mode on the cost clock (no --step-time): "
                          "vLLM's NIXL connector with a fake worker timed as kvsim's")
    if samples and cfg.parallel_sampling != "fanout":
        raise ConfigError("conform compares parallel sampling (n > 1) as vLLM 0.33 fans it out")
    diffs = []

    def stage(name: str, compare: Callable[[], Diff]) -> None:  # one comparison, announced and reported
        if on_start:
            on_start(name)
        d = compare()
        diffs.append(d)
        if on_diff:
            on_diff(d)

    if mode == "events":
        stage("events", lambda: compare_events(requests, cfg))
        return diffs
    if mode in ("manager", "both") and not offloading and not samples and cfg.kv_transfer_role is None:
        from kvsim.sim.engine.cost_model import CostModel

        cost = CostModel.from_config(cfg)
        stage("manager", lambda: run_manager(
            requests, block_size=cost.block_size, num_blocks=cost.num_gpu_blocks(cfg), max_running=max_running,
            enable_caching=cfg.enable_prefix_caching, vllm_version=cfg.vllm_version,
            sliding_window=cost.sliding_window, prefix_cache_retention_interval=cfg.prefix_cache_retention_interval,
            layers=hybrid_layers(cost), mamba_checkpoints=mamba_checkpoints(cost)))
    if mode in ("scheduler", "both"):
        stage("scheduler", lambda: run_scheduler(requests, cfg))
    return diffs
