"""Conformance with vLLM: the same workload through kvsim and through vLLM's own classes, diffed.

Two modes. `manager`: the cache-replay loop (`kvcache.replay`) over kvsim's
KVCacheManager and over vLLM's real KVCacheManager; per request, the hit
tokens, output tokens, status and preemptions must agree. `scheduler`: a
step-time run of kvsim's engine against vLLM's real Scheduler with a fake
model runner (`sim.conform.vllm_scheduler`; with `SimConfig.async_scheduling`, vLLM's
AsyncScheduler behind EngineCore's batch queue); per request, the steps that first scheduled
it, sampled its first token and finished it, its preemptions and its hit
tokens must agree. vLLM is imported only by `sim.conform.vllm_cache` and `sim.conform.vllm_scheduler`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sim.engine.config import ConfigError, SimConfig

MANAGER_FIELDS = ("hit_tokens", "output_tokens", "status", "preemptions")
SCHEDULER_FIELDS = ("first_scheduled_step", "first_token_step", "finish_step", "preemptions", "hit_tokens")
MODES = ("manager", "scheduler", "both")


@dataclass
class Diff:
    """How one mode's per-request records compare."""

    mode: str
    requests: int
    differing: int
    first: tuple[str, str, Any, Any] | None = None  # (request id, field, kvsim, vllm)

    @property
    def ok(self) -> bool:
        return self.differing == 0

    def format(self) -> str:
        head = f"{self.mode:<9} {self.requests:,} requests, {self.differing:,} differ"
        if self.first is None:
            return head
        rid, field, ours, theirs = self.first
        return f"{head}; first: request {rid!r} {field}: kvsim {ours!r}, vLLM {theirs!r}"


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
                  enable_caching: bool, vllm_version: str) -> list[dict]:
    """kvsim's cache replay, one record per request as `kvsim cache-replay --out` writes it."""
    from kvcache.manager import KVCacheManager
    from kvcache.replay import replay

    m = KVCacheManager(num_blocks, block_size, enable_caching=enable_caching, track_ids=False,
                       vllm_version=vllm_version)
    out: list[dict] = []
    replay(requests, m, max_running, lambda rec: out.append({
        "id": rec.id, "prompt_tokens": rec.prompt_tokens, "hit_tokens": rec.hit_tokens,
        "output_tokens": rec.output_tokens, "status": rec.status, "preemptions": rec.preemptions,
    }))
    return out


def kvsim_scheduler(requests: list, cfg: SimConfig) -> list[dict]:
    """kvsim's engine in step-time mode, one record per request (SCHEDULER_FIELDS)."""
    from sim.engine.run import simulate

    rq = simulate(requests, cfg).requests
    dropped = rq[rq["status"] != "finished"]
    if len(dropped):
        r = dropped.iloc[0]
        raise ConfigError(
            f"{len(dropped)} requests do not fit (first: {r['id']!r}, {r['reason']}); vLLM would "
            "stall on them: give more --num-gpu-blocks or a larger --max-num-batched-tokens"
        )
    return [
        {"id": r.id, **{f: int(getattr(r, f)) for f in SCHEDULER_FIELDS}}
        for r in rq.itertuples()
    ]


def check_workload(requests: list) -> None:
    """What the vLLM side cannot take: parallel sampling and empty prompts."""
    for r in requests:
        if r.n != 1:
            raise ConfigError(f"request {r.id!r}: n={r.n}; conform drives one sequence per request")
        if r.prompt_len < 1:
            raise ConfigError(f"request {r.id!r}: empty prompt")


def run_manager(requests: list, *, block_size: int, num_blocks: int, max_running: int,
                enable_caching: bool, vllm_version: str) -> Diff:
    from sim.conform import vllm_cache

    kw = {"block_size": block_size, "num_blocks": num_blocks, "max_running": max_running,
          "enable_caching": enable_caching}
    ours = kvsim_manager(requests, vllm_version=vllm_version, **kw)
    theirs = vllm_cache.replay_manager(requests, **kw)
    return compare("manager", ours, theirs, MANAGER_FIELDS)


def run_scheduler(requests: list, cfg: SimConfig) -> Diff:
    from sim.conform.vllm_scheduler import run_scheduler as vllm_run_scheduler
    from sim.engine.cost_model import CostModel

    ours = kvsim_scheduler(requests, cfg)
    tokens, seqs = cfg.batch_limits()
    theirs = vllm_run_scheduler(
        requests, block_size=cfg.block_size, num_gpu_blocks=CostModel.from_config(cfg).num_gpu_blocks(cfg),
        max_num_batched_tokens=tokens, max_num_seqs=seqs, enable_chunked_prefill=cfg.enable_chunked_prefill,
        enable_prefix_caching=cfg.enable_prefix_caching,
        long_prefill_token_threshold=cfg.long_prefill_token_threshold, watermark=cfg.watermark,
        step_time=cfg.step_time, scheduling=cfg.scheduling, async_scheduling=cfg.async_scheduling,
    )
    return compare("scheduler", ours, theirs, SCHEDULER_FIELDS)


def conform(requests: list, cfg: SimConfig, mode: str = "both", max_running: int = 1,
            on_diff: Callable[[Diff], None] | None = None) -> list[Diff]:
    """Run the chosen modes; `cfg` must have a step time and give the block count."""
    if mode not in MODES:
        raise ConfigError(f"--mode must be one of {', '.join(MODES)}, got {mode!r}")
    check_workload(requests)
    diffs = []
    if mode in ("manager", "both"):
        from sim.engine.cost_model import CostModel

        d = run_manager(requests, block_size=cfg.block_size,
                        num_blocks=CostModel.from_config(cfg).num_gpu_blocks(cfg), max_running=max_running,
                        enable_caching=cfg.enable_prefix_caching, vllm_version=cfg.vllm_version)
        diffs.append(d)
        if on_diff:
            on_diff(d)
    if mode in ("scheduler", "both"):
        d = run_scheduler(requests, cfg)
        diffs.append(d)
        if on_diff:
            on_diff(d)
    return diffs
