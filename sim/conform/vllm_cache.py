"""Reference runs through vLLM 0.33.0's own classes, for diffing against kvsim.

Two drivers, each returning one dict per request:

- `replay_manager`: vLLM's `KVCacheManager` under exactly the loop of
  `kvcache.replay` (same lookups, allocations and frees, in the same order),
  so its records compare 1:1 with `kvsim cache-replay --out`.
- `run_scheduler` (in `sim.conform.vllm_scheduler`): vLLM's synchronous `Scheduler`
  (or, with async_scheduling, its `AsyncScheduler` behind EngineCore's batch
  queue) with a fake model runner in step-time mode (step k starts at
  k * step_time), recording per request the steps it was first scheduled,
  sampled its first token and finished.

Both feed vLLM the token ids kvsim uses (`kvcache.sequence.Sequence`), so
decoded blocks hash alike on both sides; the shared set-up is `sim.conform.vllm_setup`.
`python -m sim.conform` runs both on two requests (the install script's self-check).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

from kvsim.sim.conform.vllm_setup import (
    FINISHED,
    REJECTED,
    TRUNCATED,
    Request,
    block_hasher,
    check_ids,
    kv_cache_config,
    require_vllm,
    stand_in_config,
    token_ids,
    vllm_request,
)


class _Live:
    """A request in flight in the manager replay: vLLM request, record, tokens."""

    __slots__ = ("vreq", "tokens", "rec", "target")

    def __init__(self, req: Request, uid: int, hasher):
        self.tokens = token_ids(req, uid)
        self.vreq = vllm_request(req, self.tokens, hasher)
        self.rec = {"id": req.id, "prompt_tokens": req.prompt_len, "hit_tokens": 0,
                    "output_tokens": 0, "status": FINISHED, "preemptions": 0}
        self.target = max(req.output_len, 1)

    def sample(self, n: int = 1) -> None:
        """Append the next `n` tokens; vLLM hashes any block they complete."""
        v = self.vreq
        v.append_output_token_ids(self.tokens[v.num_tokens : v.num_tokens + n])

    def unsample(self, n: int, block_size: int) -> None:
        """Take back the last `n` appended tokens (and hashes of blocks they completed)."""
        # NOTE: vLLM never un-samples; this mirrors replay.py's `seq.num_tokens -= n`
        # after its one-shot decode allocation fails, so the per-token retry sees
        # the same request. The allocation that failed changed nothing in the pool.
        v = self.vreq
        del v._output_token_ids[-n:]
        del v._all_token_ids[-n:]
        del v.block_hashes[v.num_tokens // block_size :]


def replay_manager(
    requests: Iterable[Request], *, block_size: int, num_blocks: int, max_running: int = 1,
    enable_caching: bool = True, sliding_window: int | None = None, prefix_cache_retention_interval: int | None = 0,
    layers: Any = None, mamba_checkpoints: bool = False,
) -> list[dict]:
    """Run vLLM's KVCacheManager under kvsim's cache-replay loop; records in completion order.

    num_blocks counts vLLM's null block 0, as KVCacheConfig.num_blocks does. `layers`: a model's
    layers mixing kinds, in vLLM's hybrid KV-cache groups (`vllm_setup.layer_specs`).
    """
    if max_running < 1:
        raise ValueError(f"max_running must be >= 1, got {max_running}")
    require_vllm()
    import tempfile

    from vllm.v1.core.kv_cache_manager import KVCacheManager

    reqs = list(requests)
    check_ids(reqs)
    max_len = max((r.prompt_len + max(r.output_len, 1) for r in reqs), default=1) + block_size
    with tempfile.TemporaryDirectory(prefix="kvsim-vllm-") as tmp:
        config = stand_in_config(tmp, max_model_len=max_len, cache={
            "block_size": block_size, "enable_prefix_caching": enable_caching,
            "prefix_cache_retention_interval": prefix_cache_retention_interval})
    manager = KVCacheManager(
        kv_cache_config(config, num_blocks, sliding_window, layers, mamba_checkpoints), max_model_len=max_len,
        scheduler_block_size=block_size, hash_block_size=block_size, enable_caching=enable_caching,
    )
    algo = config.cache_config.prefix_caching_hash_algo
    hasher = block_hasher(block_size, algo) if enable_caching else None
    lives = [_Live(r, uid, hasher) for uid, r in enumerate(reqs)]
    done: list[dict] = []
    if max_running == 1:
        _sequential(lives, manager, block_size, done, sliding_window is not None or layers is not None)
    else:
        _concurrent(lives, manager, max_running, done)
    return done


def _admit(m, live: _Live) -> int | None:
    """Look up the cached prefix and allocate the rest of the context; the hit, or None."""
    v = live.vreq
    m.new_step_starts()  # each admission a step: a Mamba hit hashed before it may be taken
    # as the Scheduler keeps it (sched/scheduler.py schedule): the junction the groups' caching reads
    blocks, hit, v.shared_prefix_boundary = m.get_computed_blocks(v)
    if m.allocate_slots(v, v.num_tokens - hit, hit, blocks) is None:
        return None
    return hit


def _sequential(lives: list[_Live], m, block_size: int, done: list[dict], windowed: bool) -> None:
    for live in lives:
        v, rec = live.vreq, live.rec
        hit = _admit(m, live)
        if hit is None:
            rec["status"] = REJECTED
            done.append(rec)
            continue
        rec["hit_tokens"] = hit
        v.num_computed_tokens = v.num_tokens
        live.sample(1)
        sampled = 1
        n = live.target - 1
        if n > 0 and not windowed:  # as kvsim's replay: a window frees blocks token by token
            live.sample(n)
            if m.allocate_slots(v, n) is not None:
                v.num_computed_tokens += n
                sampled += n
            else:
                live.unsample(n, block_size)
        while sampled < live.target:
            if m.allocate_slots(v, 1) is None:
                rec["status"] = TRUNCATED
                break
            v.num_computed_tokens += 1
            live.sample(1)
            sampled += 1
        rec["output_tokens"] = sampled
        m.free(v)
        done.append(rec)


def _concurrent(lives: list[_Live], m, k: int, done: list[dict]) -> None:
    waiting: deque[_Live] = deque(lives)
    running: list[_Live] = []
    while waiting or running:
        decoded, stalled = [], False
        for live in running:
            if m.allocate_slots(live.vreq, 1) is None:
                stalled = True
            else:
                decoded.append(live)
        admitted: list[_Live] = []
        while not stalled and waiting and len(running) + len(admitted) < k:
            live = waiting[0]
            hit = _admit(m, live)
            if hit is None:
                if running or admitted:
                    break
                waiting.popleft()
                live.rec["status"] = REJECTED
                live.rec["hit_tokens"] = 0
                done.append(live.rec)
                continue
            waiting.popleft()
            if live.rec["output_tokens"] == 0 and live.rec["preemptions"] == 0:
                live.rec["hit_tokens"] = hit
            admitted.append(live)
        for live in decoded:
            live.vreq.num_computed_tokens += 1
            live.sample(1)
            live.rec["output_tokens"] += 1
        for live in admitted:
            live.vreq.num_computed_tokens = live.vreq.num_tokens
            live.sample(1)
            live.rec["output_tokens"] += 1
        running.extend(admitted)
        for live in decoded + admitted:
            if live.rec["output_tokens"] >= live.target:
                running.remove(live)
                m.free(live.vreq)
                done.append(live.rec)
        if not decoded and not admitted and running:
            if len(running) == 1:
                live = running.pop()
                live.rec["status"] = TRUNCATED
                m.free(live.vreq)
                done.append(live.rec)
            else:
                live = running.pop()
                m.free(live.vreq)
                live.vreq.num_computed_tokens = 0
                live.rec["preemptions"] += 1
                waiting.appendleft(live)
