"""Negative controls: one kvsim rule changed on purpose, and `kvsim conform` must see it.

A conformance check that cannot fail proves nothing. Each control runs a small case on which
kvsim and vLLM 0.33 agree, then changes one rule of kvsim's with monkeypatch and requires the
diff to name the change: every mode (manager; scheduler, sync and async; scheduler with KV
offloading) has at least one. Each patch is one helper (`_<the changed rule>`) at the place the
rule lives; when the code moves, re-point the helper. Skipped (failed where
KVSIM_REQUIRE_VLLM=1, as in CI) without vLLM: `bash .ci/install_vllm_cpu.sh`.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvsim.sim.conform.check import Diff, conform, run_manager
from kvsim.sim.engine.config import SimConfig
from kvsim.workloads.request import make_request
from kvsim.workloads.traces import load_workload

pytestmark = pytest.mark.needs_vllm

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "workloads"
PROMPT = list(range(100, 132))  # two full blocks of 16


def _config(**kw) -> SimConfig:
    """The sync scheduler unless a control asks for async (its expected diffs are the sync ones)."""
    base = {"block_size": 16, "step_time": 0.05, "closed_loop_sessions": False, "async_scheduling": False}
    return SimConfig(**{**base, **kw}).validate()


def _scheduler(requests: list, **kw) -> Diff:
    (d,) = conform(requests, _config(**kw), "scheduler")
    return d


# ------------------------------------------------------------------- the changed rules
def _hit_a_whole_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefix lookup also hits a prompt's last full block, so nothing is recomputed; vLLM
    caps a hit at num_tokens - 1 (kv_cache_manager.py `get_computed_blocks`)."""
    from kvsim.kvcache.manager import KVCacheManager

    lookup = KVCacheManager.get_computed_blocks

    def whole(self: KVCacheManager, seq):
        blocks, hit = lookup(self, seq)
        n, bs = seq.num_tokens, self.block_size
        if self.enable_caching and n % bs == 0 and hit == n - bs:
            last = self.pool.get_cached_block(seq.hashes_upto(n, bs)[-1])
            if last is not None:
                return [*blocks, last], n
        return blocks, hit

    monkeypatch.setattr(KVCacheManager, "get_computed_blocks", whole)


def _append_every_freed_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """Freed blocks without a hash go to the back of the free queue, not the front
    (kvcache/profiles.py `free_unhashed_first`; vLLM block_pool.py `BlockPool.free_blocks`)."""
    from kvsim.kvcache.profiles import Profile

    monkeypatch.setattr(Profile, "free_first", lambda self, enable_caching: False)


def _requeue_preempted_at_the_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A recompute-preempted request rejoins WAITING at the back, not the front
    (vLLM scheduler.py `_preempt_request`: `self.waiting.prepend_request`)."""
    from kvsim.sim.engine.wait_queue import WaitQueue

    push = WaitQueue.push
    monkeypatch.setattr(WaitQueue, "push", lambda self, live, front=False: push(self, live))


def _preempt_the_oldest_of_the_lowest_priority(monkeypatch: pytest.MonkeyPatch) -> None:
    """Priority scheduling preempts the earliest arrival among the lowest priority, not the
    latest (vLLM scheduler.py: `max(self.running, key=lambda r: (r.priority, r.arrival_time))`)."""
    from kvsim.sim.engine import scheduler

    key = scheduler._priority_key  # (priority, arrival)

    def oldest(live) -> tuple[int, float]:
        priority, arrival = key(live)
        return priority, -arrival

    monkeypatch.setattr(scheduler, "_priority_key", oldest)


def _schedule_past_the_last_placeholder(monkeypatch: pytest.MonkeyPatch) -> None:
    """Async: a request whose in-flight placeholder reaches max_tokens is scheduled once more, not
    skipped (vLLM scheduler.py `schedule`, the RUNNING loop's num_output_placeholders check): the
    live request's `limit` (prompt + max_tokens), which that check compares with, is one more."""
    from kvsim.sim.engine.batch import Live as Holder

    init = Holder.__init__

    def one_more(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        self.limit += 1

    monkeypatch.setattr(Holder, "__init__", one_more)


def _a_pending_chunk_is_a_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    """Offloading: the tier lookup stops at a chunk whose store is in flight instead of deferring
    the request (vLLM offloading connector `_lookup_complete_chunks`)."""
    from kvsim.kvcache.offload.tier import HIT, HostTier

    def ready_only(self: HostTier, req: str, keys, first: int, tokens_per_chunk: int) -> tuple[int, bool]:  # noqa: ARG001
        hits = 0
        for key in keys:
            if self.lookup(key) != HIT:
                break
            hits += 1
        return hits, False

    monkeypatch.setattr(HostTier, "lookup_chunks", ready_only)


# ------------------------------------------------------------------------ the controls
def test_manager_sees_a_whole_prompt_hit(monkeypatch: pytest.MonkeyPatch):
    # b repeats a's 32-token prompt: vLLM hits 16 tokens and recomputes the last block
    reqs = [make_request("a", 0.0, PROMPT, 4), make_request("b", 1.0, PROMPT, 4),
            make_request("c", 2.0, [*PROMPT, 7], 4)]

    def run() -> Diff:
        return run_manager(reqs, block_size=16, num_blocks=20, max_running=1, enable_caching=True,
                           vllm_version="0.33")

    assert run() == Diff("manager", 3, 0)
    _hit_a_whole_prompt(monkeypatch)
    assert run() == Diff("manager", 3, 1, ("b", "hit_tokens", 32, 16))


def test_manager_sees_a_different_free_queue_order(monkeypatch: pytest.MonkeyPatch):
    reqs = list(load_workload(GOLDEN / "shared-prefix.jsonl"))

    def run() -> Diff:
        return run_manager(reqs, block_size=16, num_blocks=24, max_running=1, enable_caching=True,
                           vllm_version="0.33")

    assert run() == Diff("manager", 150, 0)
    _append_every_freed_block(monkeypatch)
    assert run() == Diff("manager", 150, 8, ("sp-48", "hit_tokens", 0, 16))


def test_scheduler_sees_a_preempted_request_requeued_at_the_back(monkeypatch: pytest.MonkeyPatch):
    # sessions in 60 blocks: recompute preemptions
    reqs = list(load_workload(GOLDEN / "multi-turn.jsonl"))
    kw = {"num_gpu_blocks": 60, "max_num_batched_tokens": 256}
    assert _scheduler(reqs, **kw) == Diff("scheduler", 120, 0)
    _requeue_preempted_at_the_back(monkeypatch)
    assert _scheduler(reqs, **kw) == Diff("scheduler", 120, 102, ("mt-4-1", "finish_step", 177, 167))


def test_scheduler_sees_a_different_preemption_victim(monkeypatch: pytest.MonkeyPatch):
    # six arrivals a second at three priorities in 30 blocks (test_conform.py's priority case)
    rng = random.Random(5)
    reqs = [make_request(f"r{i}", float(i // 6), range(i * 1000, i * 1000 + rng.randint(5, 120)),
                         rng.randint(1, 30), priority=rng.randint(-1, 1)) for i in range(60)]
    kw = {"step_time": 1.0, "num_gpu_blocks": 30, "max_num_batched_tokens": 128, "max_num_seqs": 8,
          "scheduling": "priority"}
    assert _scheduler(reqs, **kw) == Diff("scheduler", 60, 0)
    _preempt_the_oldest_of_the_lowest_priority(monkeypatch)
    assert _scheduler(reqs, **kw) == Diff("scheduler", 60, 18, ("r1", "finish_step", 135, 128))


def test_async_scheduler_sees_a_placeholder_rule(monkeypatch: pytest.MonkeyPatch):
    reqs = list(load_workload(GOLDEN / "multi-turn.jsonl"))
    kw = {"num_gpu_blocks": 400, "max_num_batched_tokens": 256, "max_num_seqs": 4, "async_scheduling": True}
    assert _scheduler(reqs, **kw) == Diff("scheduler", 120, 0)
    _schedule_past_the_last_placeholder(monkeypatch)
    assert _scheduler(reqs, **kw) == Diff("scheduler", 120, 29, ("mt-2-0", "first_scheduled_step", 67, 66))


def test_offloading_sees_a_different_tier_lookup(monkeypatch: pytest.MonkeyPatch):
    # C repeats A's 4-block prompt at step 3, while A's store (5 steps a block) is in flight: the
    # GPU hits 48 tokens, and vLLM defers C until the tier holds the last block, then loads it;
    # changed, kvsim runs C at once. (C's step in vLLM is kvsim's unchanged one, as they agree:
    # it follows the store timing, not this control.)
    from kvsim.sim.conform.check import kvsim_scheduler
    from kvsim.sim.engine.cost_model import CostModel

    cost = CostModel.from_config(SimConfig(block_size=16))
    step = cost.op_cost_s["store"] / 5  # a block takes 5 steps on the host link
    prompt = list(range(1000, 1064))
    reqs = [make_request("A", 0, prompt, 2), make_request("C", 3 * step, prompt, 2)]
    kw = {"num_gpu_blocks": 9, "max_num_batched_tokens": 256, "max_num_seqs": 8, "step_time": step,
          "kv_offloading_size": 16 * cost.kv_bytes_per_block / (1 << 30)}
    assert _scheduler(reqs, **kw) == Diff("scheduler", 2, 0)
    waited = kvsim_scheduler(reqs, _config(**kw))[1]["first_scheduled_step"]
    _a_pending_chunk_is_a_miss(monkeypatch)
    assert _scheduler(reqs, **kw) == Diff("scheduler", 2, 1, ("C", "first_scheduled_step", 3, waited),
                                          ("offload_hit_tokens", 0, 16))
