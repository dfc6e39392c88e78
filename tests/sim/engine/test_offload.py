"""KV offloading in the engine (sim.engine.offload, vLLM 0.33's OffloadingConnector scheduler side):
stores of computed prompt chunks, a later admission's prefix loaded back from the host tier."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kvsim.kvcache.offload.tier import HostTier
from kvsim.kvcache.sequence import Sequence
from kvsim.sim.engine.config import ConfigError, SimConfig
from kvsim.sim.engine.cost_model import CostModel
from kvsim.sim.engine.host_link import Job, Link
from kvsim.sim.engine.offload import Offloader
from kvsim.sim.engine.run import simulate
from kvsim.workloads.request import Workload
from tests.sim.engine.engine_fixtures import FlatCost, req

MIB = 1 << 20


class HostLinkCost(FlatCost):
    """Flat 1 s steps; a GPU block is 1 MiB and takes `link_s` seconds each way on the host link."""

    def __init__(self, link_s: float = 0.0):
        super().__init__(1.0)
        self.kv_bytes_per_block = MIB
        self.op_cost_s = {"load": link_s, "store": link_s}


def _run(requests, chunks: int = 16, link_s: float = 0.0, **cfg):
    """Under the sync scheduler (the times below are worked out for it) unless `cfg` says otherwise."""
    base = {"block_size": 4, "num_gpu_blocks": 8, "kv_offloading_size": chunks * MIB / (1 << 30),
            "async_scheduling": False}
    c = SimConfig(**{**base, **cfg})
    return simulate(Workload.from_list(requests, "test"), c, cost_model=HostLinkCost(link_s))


def _evicted_prefix():
    """a's 16-token prompt is stored in the tier; f's 24 tokens then evict a's blocks from the
    GPU; b repeats a's prompt plus 4 tokens."""
    a = np.arange(100, 116)
    return [req("a", 0, a, 2), req("f", 10, 24, 2), req("b", 20, np.concatenate([a, np.arange(500, 504)]), 2)]


def test_a_prefix_evicted_from_the_gpu_is_loaded_back_from_the_tier() -> None:
    res = _run(_evicted_prefix())
    r = res.requests.set_index("id")
    s = res.summary
    assert r["hit_tokens"].tolist() == [0, 0, 0]  # no GPU hit: b's prefix came from the tier
    assert s["offload_hit_tokens"] == 16
    assert s["loaded_blocks"] == 4
    # a's 4 prompt chunks, f's 6, b's own last one (its first 4 were loaded, not offered again)
    assert s["stored_blocks"] == 4 + 6 + 1
    assert (s["stored_bytes"], s["loaded_bytes"]) == (11 * MIB, 4 * MIB)
    assert s["total_hit_rate"] == 16 / (16 + 24 + 20)
    # b's load is applied at once (an empty step polls it), then b prefills its last 4 tokens
    assert r.loc["b", "first_scheduled"] == 20.0 and r.loc["b", "first_token"] == 21.0


def test_a_load_takes_its_blocks_over_the_host_link() -> None:
    """b's 4-block load, planned in the empty step at t=20, takes 4 * 0.5 s: b runs at 22."""
    r = _run(_evicted_prefix(), link_s=0.5).requests.set_index("id")
    assert (r.loc["b", "first_scheduled"], r.loc["b", "first_token"]) == (22.0, 23.0)


def test_a_finished_request_s_store_is_flushed_when_its_blocks_are_reused() -> None:
    """a's stores (planned at step 0, started when step 1 starts at t=1) would take 4 * 5 s, but at
    t=10 f takes a's freed blocks: the worker finishes the store first (vLLM `_build_connector_meta`
    flushes jobs whose blocks are reallocated), so at t=20 b finds a's chunks ready, loads them
    for 4 * 5 s and runs at t=40."""
    res = _run(_evicted_prefix(), link_s=5.0)
    r = res.requests.set_index("id")
    assert (r.loc["b", "first_scheduled"], r.loc["b", "first_token"]) == (40.0, 41.0)
    assert res.summary["offload_hit_tokens"] == 16


def test_a_full_prompt_hit_loads_every_block_and_recomputes_the_last_token() -> None:
    """vLLM's tier lookup may cover the whole prompt (`_lookup_complete_chunks` stops at
    num_tokens, not num_tokens - 1); once loaded, the last token is computed again
    (vllm/v1/core/sched/scheduler.py `_update_waiting_for_remote_kv`)."""
    a = np.arange(100, 116)
    res = _run([req("a", 0, a, 2), req("f", 10, 24, 2), req("b", 20, a.copy(), 2)])
    assert res.summary["offload_hit_tokens"] == 16 and res.summary["loaded_blocks"] == 4
    assert res.steps.loc[res.steps["time"] == 20.0, "prefill_tokens"].tolist() == [1]


def test_a_tier_too_small_for_a_request_fails_its_stores_and_retries() -> None:
    """2 chunks cannot take a 4-chunk offer (nothing evictable): every offer fails and is made
    again at the request's next scheduled step (vLLM `_build_store_jobs`: next_stored_chunk_idx
    does not advance on None), and a finished request's once more at the next step, an empty one
    taken at once (vllm/v1/core/sched/scheduler.py `has_requests`: finished requests keep the
    engine stepping): a, f and b offer 3 times each."""
    s = _run(_evicted_prefix(), chunks=2).summary
    assert (s["stored_blocks"], s["offload_store_failures"], s["offload_hit_tokens"]) == (0, 9, 0)


def test_store_threshold_two_stores_a_chunk_the_second_time_it_is_offered() -> None:
    """vLLM `CPUOffloadingManager.prepare_store` with store_threshold 2: a's chunks are offered once
    (skipped, and not offered again by a), then by b, which stores them; b's own is skipped."""
    s = _run(_evicted_prefix(), offload_store_threshold=2).summary
    assert (s["stored_blocks"], s["offload_hit_tokens"]) == (4, 0)


@pytest.mark.parametrize("change", [{"preemption": "swap", "num_cpu_blocks": 4},
                                    {"defrag_threshold": 4}, {"kv_offloading_size": -1.0},
                                    {"offload_eviction_policy": "fifo"}])
def test_unsupported_combinations_are_config_errors(change) -> None:
    """record_ops is supported: tests/gpu/test_offload_replay.py replays the store and load ops."""
    with pytest.raises(ConfigError, match="kv_offloading_size|offload_eviction_policy"):
        SimConfig(**{"kv_offloading_size": 1.0, **change}).validate()


def test_offloading_takes_the_release_in_any_spelling():
    assert SimConfig(kv_offloading_size=1.0, vllm_version="0.33.0").validate().vllm_version == "0.33.0"
    with pytest.raises(ConfigError, match="cannot be combined with vllm_version 0.32.1"):
        SimConfig(kv_offloading_size=1.0, vllm_version="0.32.1").validate()


@pytest.mark.parametrize(("async_scheduling", "offloading", "deferred"), [(True, True, True), (True, False, False),
                                                                         (False, True, False)])
def test_frees_are_deferred_only_with_batches_in_flight_and_a_connector(async_scheduling, offloading, deferred):
    """vllm/v1/core/sched/scheduler.py `Scheduler.__init__`: defer_block_free with more than one batch in
    flight (async scheduling) and a KV consumer connector (offloading runs as kv_both); async scheduling
    with offloading is what `vllm serve --kv-offloading-size` runs by default (the conform cases with
    vLLM are in tests/sim/conform/test_conform_offload.py)."""
    from kvsim.sim.engine.loop import build_scheduler
    from kvsim.sim.engine.metrics import RequestLog
    from kvsim.sim.engine.run import make_manager

    cfg = SimConfig(async_scheduling=async_scheduling, kv_offloading_size=1.0 if offloading else None,
                    num_gpu_blocks=64).validate()
    cost = CostModel.from_config(cfg)
    sched = build_scheduler(cfg, make_manager(cfg, cost), RequestLog(), cost)
    assert (sched.defer_frees, sched.connector is not None) == (deferred, offloading)


def test_a_step_s_stores_start_when_the_next_step_starts() -> None:
    """vLLM's worker holds step N's store jobs (vllm/distributed/kv_transfer/kv_connector/v1/offloading/
    worker.py `prepare_store_kv`) and submits them in step N+1's `handle_preemptions`, which
    vllm/v1/worker/gpu_model_runner.py `execute_model` calls before the forward: a's 4-block store,
    planned at t=0, runs 1 to 2 (0.25 s a block), not from the end of step 1's forward (t=2).
    b, a's prompt again at t=2, hits 12 tokens on the GPU; its last chunk is still pending for the
    schedule at 2 (the store is applied when that step ends), ready in the empty step after it:
    b loads one block, 2 to 2.25, and runs at 2.25 (3.25 with stores started a step later)."""
    a = np.arange(100, 116)
    res = _run([req("a", 0, a, 2), req("b", 2, a.copy(), 2)], link_s=0.25)
    r = res.requests.set_index("id")
    assert (r.loc["b", "first_scheduled"], r.loc["b", "first_token"], r.loc["b", "hit_tokens"]) == (2.25, 3.25, 12)
    assert (res.summary["offload_hit_tokens"], res.summary["loaded_blocks"]) == (4, 1)


def _job(blocks: int) -> Job:
    return Job("store", "r", [], blocks)


def test_a_link_waited_on_finishes_the_jobs_ahead_and_restarts_those_behind() -> None:
    """vllm/v1/kv_offload/cpu/gpu_worker.py `SingleDirectionOffloadingHandler`: each copy's stream
    waits for the previous copy's end event (`transfer_async`), and `wait` synchronizes on one
    job's end event, so every copy ahead of it is over too. kvsim's wait takes no time: at t=3 the
    jobs up to the one waited for are done, the one behind runs from 3."""
    link = Link(1.0)
    first, second, third = _job(4), _job(2), _job(2)
    for at, job in enumerate((first, second, third)):
        link.start(job, at)
    assert (first.done_at, second.done_at, third.done_at) == (4.0, 6.0, 8.0)
    link.wait(second, 3.0)
    assert (first.done_at, second.done_at, third.done_at) == (3.0, 3.0, 5.0)
    unstarted = _job(1)  # a store planned in the step that flushes it: submitted behind all others
    link.wait(unstarted, 3.5)
    assert (third.done_at, unstarted.done_at) == (3.5, 3.5)
    later = _job(1)
    link.start(later, 3.5)
    assert later.done_at == 4.5


def _prompt(sid: str, first: int, n: int) -> Sequence:
    return Sequence(sid, np.arange(first, first + n))


def _blocks(*ids: int) -> list:
    return [SimpleNamespace(block_id=i) for i in ids]


def test_a_flush_completes_the_stores_queued_ahead_of_it_and_frees_their_chunks() -> None:
    """An 8-chunk tier, block size 4, 5 s a block. a, b, c are scheduled at t=0, 1, 2 and offer 4,
    2 and 2 chunks; each step's store starts when the next step starts (a's 1 to 21, b's to 31,
    c's to 41). b is preempted at t=3: vLLM's worker waits for b's store (worker.py
    `handle_preemptions`, `jobs_to_flush`), and copies on one direction end in order
    (gpu_worker.py `SingleDirectionOffloadingHandler.wait`), so a's ends too: both are done at 3,
    and c's runs 3 to 13. At t=4 d offers 4 chunks: a's and b's 6 are evictable, so it is accepted.
    Completing b's alone (a's left pending until 21) refused d's offer: 2 evictable chunks."""
    off = Offloader(HostTier(8), 4, seconds_per_block=(0.0, 5.0))
    a, b, c, d = _prompt("a", 100, 16), _prompt("b", 200, 8), _prompt("c", 300, 8), _prompt("d", 400, 16)

    def step(now: float, scheduled: list, preempted: tuple = ()) -> None:
        off.begin_step(now)
        for seq in preempted:
            off.preempted(seq, now)
        off.end_step(scheduled, now)

    for now, seq, blocks in ((0.0, a, _blocks(0, 1, 2, 3)), (1.0, b, _blocks(4, 5)), (2.0, c, _blocks(6, 7))):
        step(now, [(seq, seq.num_tokens, blocks)])
        off.step_ended(now, now + 1.0)
    step(3.0, [], preempted=(b,))
    assert {j: job.done_at for j, job in off.jobs.items()} == {0: 3.0, 1: 3.0, 2: 13.0}
    off.step_ended(3.0, 4.0)  # the poll at 3 saw a's and b's: applied when the step ends
    assert list(off.jobs) == [2]
    step(4.0, [(d, 16, _blocks(4, 5, 8, 9))])
    assert (off.tier.num_alloc_failures, off.tier.num_evictions, off.stored_blocks) == (0, 4, 12)
