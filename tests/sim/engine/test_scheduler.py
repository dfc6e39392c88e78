"""The scheduling step on hand-built cases: budgets, chunks, order, preemption, swap, fork."""

from __future__ import annotations

import numpy as np

from kvsim.sim.engine.metrics import FINISHED, REASONS, REJECTED
from tests.sim.engine.engine_fixtures import make_scheduler, req, step


def ids(s) -> list[str]:
    return [live.req.id for live in s.running]


def test_long_prompt_is_chunked_under_the_token_budget() -> None:
    s = make_scheduler(max_num_batched_tokens=8)
    s.add(req("a", 0, 20, 3), 0)
    got = [step(s, t) for t in range(5)]
    assert got == [[("a", 8)], [("a", 8)], [("a", 4)], [("a", 1)], [("a", 1)]]
    assert s.log.first_token[0] == 3.0  # end of the step that completed the prefill
    assert s.log.finish[0] == 5.0 and s.log.status[0] == FINISHED
    assert s.log.output_tokens[0] == 3
    assert not s.has_work() and s.m.num_used_blocks() == 0


def test_running_first_then_waiting_share_the_budget() -> None:
    s = make_scheduler(max_num_batched_tokens=8)
    s.add(req("a", 0, 6, 4), 0)
    s.add(req("b", 0, 10, 4), 0)
    assert step(s, 0) == [("a", 6), ("b", 2)]
    assert step(s, 1) == [("a", 1), ("b", 7)]  # a's decode first, b's next chunk takes the rest
    assert step(s, 2) == [("a", 1), ("b", 1)]
    assert s.log.first_token[:2].tolist() == [1.0, 3.0]


def test_without_chunked_prefill_a_prompt_waits_for_a_step_it_fits() -> None:
    s = make_scheduler(max_num_batched_tokens=12, enable_chunked_prefill=False)
    s.add(req("a", 0, 6, 4), 0)
    s.add(req("b", 0, 10, 4), 0)
    assert step(s, 0) == [("a", 6)]  # b's 10 tokens do not fit the 6 left
    assert step(s, 1) == [("a", 1), ("b", 10)]


def test_max_num_seqs_limits_admission() -> None:
    s = make_scheduler(max_num_seqs=2)
    for r in "abc":
        s.add(req(r, 0, 4, 2), 0)
    assert step(s, 0) == [("a", 4), ("b", 4)]
    assert step(s, 1) == [("a", 1), ("b", 1)]  # both finish: c is admitted next step
    assert step(s, 2) == [("c", 4)]


def test_out_of_blocks_preempts_the_newest_and_requeues_it_at_the_front() -> None:
    # 6 usable blocks of 4: three 8-token prompts fill them; the next decode needs a block.
    s = make_scheduler(num_gpu_blocks=7, max_num_seqs=3)
    for r in "abcd":
        s.add(req(r, 0, 8, 10), 0)
    assert step(s, 0) == [("a", 8), ("b", 8), ("c", 8)]
    assert s.m.pool.num_free_blocks == 0
    assert step(s, 1) == [("a", 1), ("b", 1)]  # c (newest) was preempted to make room
    assert ids(s) == ["a", "b"]
    assert [live.req.id for live in s.waiting._q] == ["c", "d"]  # c at the front, before d
    c = s.waiting.peek()
    assert c.seq.num_computed_tokens == 0 and c.seq.num_tokens == 9
    assert s.log.preemptions.tolist()[:4] == [0, 0, 1, 0]


def test_a_request_preempts_itself_when_it_is_the_newest() -> None:
    s = make_scheduler(num_gpu_blocks=5, max_num_seqs=2)  # 4 usable blocks
    s.add(req("a", 0, 7, 10), 0)
    s.add(req("b", 0, 8, 10), 0)
    assert step(s, 0) == [("a", 7), ("b", 8)]
    # a's decode fits its last block; b needs a third block and is itself the newest.
    assert step(s, 1) == [("a", 1)]
    assert ids(s) == ["a"] and s.waiting.peek().req.id == "b"
    assert s.m.block_ids("a") == [1, 2] and s.m.pool.num_free_blocks == 2


def test_recompute_readmission_hits_its_own_cached_blocks() -> None:
    s = make_scheduler(num_gpu_blocks=7, max_num_seqs=3)
    for r in "abc":
        s.add(req(r, 0, 8, 3), 0)
    step(s, 0)
    step(s, 1)  # c preempted; a, b decode (and evict c's cached blocks)
    step(s, 2)  # a, b finish
    assert ids(s) == [] and s.log.status[:2].tolist() == [FINISHED, FINISHED]
    assert step(s, 3) == [("c", 9)]  # prompt + its first sampled token, recomputed
    assert s.log.hit_tokens[2] == 0  # hit counted at first admission only


def test_swap_round_trip_restores_the_request() -> None:
    s = make_scheduler(num_gpu_blocks=7, max_num_seqs=3, preemption="swap", num_cpu_blocks=8)
    for r in "abc":
        s.add(req(r, 0, 8, 3), 0)
    step(s, 0)
    assert step(s, 1) == [("a", 1), ("b", 1)]
    assert [live.req.id for *_, live in s.swapped] == ["c"]
    assert s.m.ops.counts["swap_out"] == 2 and s.m.cpu.num_free_blocks == 6
    assert step(s, 2) == [("a", 1), ("b", 1)]  # a and b finish; c cannot come back yet
    assert step(s, 3) == [("c", 1)]  # swapped in, decodes where it stopped
    assert s.m.ops.counts["swap_in"] == 2 and s.m.cpu.num_free_blocks == 8
    step(s, 4)
    assert s.log.status[2] == FINISHED and s.log.output_tokens[2] == 3
    assert s.log.preemptions[2] == 1


def test_parallel_sampling_fans_out_into_n_requests_sharing_the_prompt_through_the_cache() -> None:
    # vllm 0.33 vllm/v1/engine/parallel_sampling.py ParentRequest.get_child_info: n requests
    # "{j}_{id}", each admitted on its own; the later ones hit the first's full block (cached
    # at allocation) and compute the partial last block again. One row, closed by the last.
    s = make_scheduler()
    s.add(req("a", 0, 6, 3, n=3), 0)
    assert step(s, 0) == [("0_a", 6), ("1_a", 2), ("2_a", 2)]
    assert [s.m.block_ids(x)[0] for x in ("0_a", "1_a", "2_a")] == [1, 1, 1]
    assert len({s.m.block_ids(x)[1] for x in ("0_a", "1_a", "2_a")}) == 3 and s.m.num_cow_copies == 0
    assert (s.log.hit_tokens[0], s.log.first_token_step[0]) == (4 + 4, 0)  # each later sample's hit counts
    step(s, 1)
    step(s, 2)
    assert s.log.status[0] == FINISHED and s.log.output_tokens[0] == 9 and s.log.finish[0] == 3.0
    assert [r.id for r in s.done] == ["a"]


def test_v0_parallel_sampling_forks_after_prefill_and_copies_on_write() -> None:
    s = make_scheduler(parallel_sampling="fork")
    s.add(req("a", 0, 6, 3, n=3), 0)
    assert step(s, 0) == [("a", 6)]
    assert ids(s) == ["a", "a", "a"]
    shared = s.m.block_ids("a")
    assert s.m.block_ids("a/1") == shared == s.m.block_ids("a/2")
    assert [s.m.pool.blocks[i].ref_cnt for i in shared] == [3, 3]
    assert step(s, 1) == [("a", 1), ("a/1", 1), ("a/2", 1)]
    # the partial last block was shared: the first two writers copy it, the last writes in place
    assert s.m.num_cow_copies == 2
    assert len({tuple(s.m.block_ids(x)) for x in ("a", "a/1", "a/2")}) == 3
    assert s.m.block_ids("a")[0] == s.m.block_ids("a/1")[0] == shared[0]
    step(s, 2)
    assert s.log.status[0] == FINISHED and s.log.output_tokens[0] == 9 and s.log.finish[0] == 3.0


def test_fcfs_head_of_line_blocks_smaller_requests_behind_it() -> None:
    s = make_scheduler(num_gpu_blocks=9)  # 8 usable blocks
    s.add(req("a", 0, 20, 8), 0)  # 5 blocks
    s.add(req("b", 0, 16, 8), 0)  # 4 blocks: does not fit beside a
    s.add(req("c", 0, 4, 8), 0)  # 1 block: would fit, but waits behind b
    assert step(s, 0) == [("a", 20)]
    assert step(s, 1) == [("a", 1)]
    assert [live.req.id for live in s.waiting._q] == ["b", "c"]


def test_blocked_head_shortcut_agrees_with_a_real_retry() -> None:
    s = make_scheduler(num_gpu_blocks=9)
    s.add(req("a", 0, 20, 3), 0)
    s.add(req("b", 0, 16, 3), 0)
    step(s, 0)
    blocked = s.fast.blocked
    assert blocked is not None and blocked.live.req.id == "b" and blocked.deficit == 1
    assert blocked.still(blocked.live, 8192 - 1, True)
    step(s, 1)
    assert step(s, 2) == [("a", 1)]  # a finishes this step, freeing 6 blocks
    assert not s.fast.blocked.still(s.waiting.peek(), 8192 - 1, True)
    assert step(s, 3) == [("b", 16)]


def test_watermark_applies_only_beside_other_scheduled_requests() -> None:
    s = make_scheduler(num_gpu_blocks=11, watermark=0.5)  # 10 usable, keep 5 free
    s.add(req("a", 0, 24, 4), 0)  # 6 blocks: admitted alone, leaving 4 free
    s.add(req("b", 0, 4, 4), 0)  # 1 block, but only 4 - 1 < 5 would stay free
    assert step(s, 0) == [("a", 24)]
    assert step(s, 1) == [("a", 1)]
    s2 = make_scheduler(num_gpu_blocks=11)
    s2.add(req("a", 0, 24, 4), 0)
    s2.add(req("b", 0, 4, 4), 0)
    assert step(s2, 0) == [("a", 24), ("b", 4)]


def test_priority_scheduling_admits_lower_values_first() -> None:
    s = make_scheduler(scheduling="priority", max_num_seqs=1)
    for r, p in (("a", 2), ("b", 0), ("c", 1), ("d", 0)):
        s.add(req(r, 0, 4, 1, priority=p), 0)
    assert [step(s, t)[0][0] for t in range(4)] == ["b", "d", "c", "a"]


def test_requests_that_can_never_run_are_rejected_with_a_reason() -> None:
    # n > max_num_seqs never runs only when its samples are forked together (v0); fanned out they queue
    s = make_scheduler(num_gpu_blocks=5, max_num_seqs=2, enable_chunked_prefill=False,
                       max_num_batched_tokens=32, parallel_sampling="fork")
    s.add(req("big", 0, 17, 1), 0)  # 5 blocks > 4 usable
    s.add(req("wide", 0, 4, 1, n=3), 0)
    s.add(req("long", 0, 33, 1), 0)
    s.add(req("ok", 0, 4, 1), 0)
    assert [REASONS[r] for r in s.log.reason[:4]] == [
        "prompt_exceeds_cache", "n_exceeds_max_num_seqs", "prompt_exceeds_batch", ""]
    assert s.log.status[:3].tolist() == [REJECTED] * 3
    assert [r.id for r in s.done] == ["big", "wide", "long"]
    assert step(s, 0) == [("ok", 4)]


def test_max_model_len_rejects_full_prompts_and_stops_growth() -> None:
    """As vLLM: a prompt must leave room for one output token; a sequence stops at the limit."""
    s = make_scheduler(max_model_len=10)
    s.add(req("full", 0, 10, 3), 0)  # no room for an output token
    s.add(req("fits", 0, 9, 1), 0)
    s.add(req("capped", 0, 7, 8), 0)  # 7 + 8 > 10: stops after 3 output tokens
    assert [REASONS[r] for r in s.log.reason[:3]] == ["prompt_exceeds_max_model_len", "", ""]
    assert s.log.status[0] == REJECTED
    got = [step(s, t) for t in range(4)]
    assert got == [[("fits", 9), ("capped", 7)], [("capped", 1)], [("capped", 1)], []]
    assert s.log.output_tokens[1:3].tolist() == [1, 3]
    assert s.log.status[1:3].tolist() == [FINISHED] * 2 and not s.has_work()


def test_prefix_hit_at_admission_skips_cached_tokens() -> None:
    s = make_scheduler()
    shared = np.arange(100, 112)
    s.add(req("a", 0, np.concatenate([shared, [1, 2]]), 1), 0)
    step(s, 0)
    s.add(req("b", 1, np.concatenate([shared, [3]]), 1), 1)
    s.add(req("c", 1, shared, 1), 1)
    assert step(s, 1) == [("b", 1), ("c", 4)]  # b: 12 of 13 hit; c: at most 11 of 12, so 8
    assert s.log.hit_tokens[:3].tolist() == [0, 12, 8]
