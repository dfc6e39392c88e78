"""vLLM 0.33 scheduler rules, pinned with exact step numbers in step-time runs.

Each test names the vLLM function the rule comes from (vllm/v1/core/sched/scheduler.py
`Scheduler.schedule` unless said otherwise). With `step_time=1`, step k starts at
t = k; a request is queued before the first step at or after its arrival.
"""

from __future__ import annotations

import pytest

from kvsim.sim.engine.config import SimConfig
from kvsim.sim.engine.loop import grid_index
from kvsim.sim.engine.run import simulate
from kvsim.workloads.request import make_request

_next = [0]


def req(rid: str, arrival: float, prompt_len: int, output_len: int):
    """A request with prompt tokens no other request shares."""
    start = _next[0]
    _next[0] += prompt_len
    return make_request(rid, arrival, range(start, start + prompt_len), output_len)


# the steps below are worked out for vLLM's step-by-step (sync) scheduler, `Scheduler.schedule`
# applying each step's output before the next is scheduled (not `vllm serve` 0.33's async default)
SYNC = {"async_scheduling": False}


def steps(reqs, **cfg) -> dict[str, tuple[int, int, int, int]]:
    """id -> (first_scheduled_step, first_token_step, finish_step, preemptions), under the sync scheduler."""
    base = {"step_time": 1.0, "block_size": 4, "closed_loop_sessions": False, **SYNC}
    res = simulate(reqs, SimConfig(**{**base, **cfg}))
    rq = res.requests
    cols = ["first_scheduled_step", "first_token_step", "finish_step", "preemptions"]
    return {r.id: tuple(int(getattr(r, c)) for c in cols) for r in rq.itertuples()}


def test_grid_index_is_the_first_step_at_or_after():
    assert [grid_index(t, 1.0) for t in (0.0, 0.5, 1.0, 10.2)] == [0, 1, 1, 11]
    assert grid_index(0.3, 0.1) == 3 and grid_index(0.7, 0.1) == 7  # 0.7 / 0.1 = 6.999...


def test_steps_start_on_the_grid_and_an_idle_engine_waits_for_the_next_arrival():
    got = steps([req("a", 0.0, 40, 3), req("b", 0.5, 20, 1), req("c", 10.2, 10, 2)],
                block_size=16, num_gpu_blocks=100, max_num_batched_tokens=64)
    # a: whole prompt in step 0, decodes in 1 and 2; b queued before step 1; c wakes step 11
    assert got == {"a": (0, 0, 2, 0), "b": (1, 1, 1, 0), "c": (11, 11, 12, 0)}


def test_newest_running_request_is_preempted_and_nothing_is_admitted_that_step():
    # 3 usable blocks of 4 slots, caching off. Step 1: a takes the last free block for its
    # decode, b (running[-1]) finds none and preempts itself (vLLM: `self.running.pop()`,
    # `_preempt_request` requeues it at the front of WAITING); the step admits nothing
    # (`if not preempted_reqs`) though c's one block is free. b's recompute needs 2 blocks
    # for its 5 known tokens, so b, and c behind it, wait until a ends at step 5.
    got = steps([req("a", 0, 4, 6), req("b", 0, 4, 6), req("c", 0.5, 1, 1)],
                num_gpu_blocks=4, enable_prefix_caching=False)
    assert got == {"a": (0, 0, 5, 0), "b": (0, 0, 10, 1), "c": (6, 6, 6, 0)}


@pytest.mark.parametrize("watermark,c_first", [(0.2, 2), (0.0, 0)])
def test_watermark_applies_while_anything_runs(watermark, c_first):
    # vllm/v1/core/kv_cache_manager.py allocate_slots(has_scheduled_reqs=bool(self.running)):
    # 10 usable blocks, watermark int(0.2 * 11) = 2. a (7 blocks) is admitted with nothing
    # running, b (1 block) leaves exactly 2 free, c would eat into them and waits.
    got = steps([req("a", 0, 28, 2), req("b", 0, 4, 2), req("c", 0, 4, 1)],
                num_gpu_blocks=11, watermark=watermark)
    assert got["c"][0] == c_first
    assert got["a"] == (0, 0, 1, 0) and got["b"][0] == 0


def test_a_waiting_request_is_admitted_only_if_its_whole_prompt_fits():
    # scheduler_reserve_full_isl (default True) -> allocate_slots(full_sequence_must_fit=True):
    # b's first 4-token chunk would fit in the 2 free blocks, its 12-token prompt does not
    got = steps([req("a", 0, 12, 4), req("b", 0, 12, 1)], num_gpu_blocks=6, max_num_batched_tokens=8)
    assert got == {"a": (0, 1, 4, 0), "b": (5, 6, 6, 0)}


def test_long_prefill_threshold_caps_chunks_unless_one_request_is_alone():
    kw = {"block_size": 16, "num_gpu_blocks": 100, "max_num_batched_tokens": 64,
          "long_prefill_token_threshold": 16}
    # 0.31+: a lone request takes the whole budget (num_running + num_waiting == 1)
    assert steps([req("a", 0, 40, 1)], **kw) == {"a": (0, 0, 0, 0)}
    # 0.28: 16 + 16 + 8 tokens
    assert steps([req("a", 0, 40, 1)], vllm_version="0.28", **kw) == {"a": (0, 2, 2, 0)}
    # two requests: 16 tokens each per step, both finish their prompt in step 2
    assert steps([req("a", 0, 40, 1), req("b", 0, 40, 1)], **kw) == {"a": (0, 2, 2, 0), "b": (0, 2, 2, 0)}


def test_hit_tokens_are_those_of_the_first_scheduling():
    # b shares a's first two full blocks (8 tokens); a full-prompt hit still recomputes its
    # last token (vllm/v1/core/kv_cache_manager.py get_computed_blocks: num_tokens - 1)
    a = make_request("a", 0, range(1000, 1010), 1)
    b = make_request("b", 1, [*range(1000, 1008), 7, 8], 1)
    c = make_request("c", 2, range(1000, 1008), 1)
    res = simulate([a, b, c], SimConfig(step_time=1.0, block_size=4, num_gpu_blocks=20, **SYNC))
    assert res.requests["hit_tokens"].tolist() == [0, 8, 4]


def test_a_fanned_out_request_counts_each_samples_prompt_and_hit():
    # DESIGN.md: prefix hit rate = prompt tokens served from cache / prompt tokens scheduled.
    # Fanned out (vllm/v1/engine/parallel_sampling.py), each of the 3 samples schedules the
    # 6-token prompt and the later two hit the first one's full block; forked (v0), only one does
    reqs = [make_request("a", 0, range(100, 106), 3, n=3)]
    cfg = SimConfig(step_time=1.0, block_size=4, num_gpu_blocks=20, **SYNC)
    fan = simulate(reqs, cfg).summary
    fork = simulate(reqs, cfg.replace(parallel_sampling="fork")).summary
    assert (fan["prompt_tokens"], fan["hit_tokens"], fan["hit_rate"], fan["block_hit_rate"]) == (18, 8, 8 / 18, 2 / 6)
    assert (fork["prompt_tokens"], fork["hit_tokens"], fork["hit_rate"], fork["cow_copies"]) == (6, 0, 0.0, 2)


def test_priority_order_is_priority_then_arrival_then_request_id():
    # vllm/v1/request.py Request.__lt__: ties in priority and arrival go by request id as a
    # string, so "r10" runs before "r2"; one sequence at a time makes the order visible
    reqs = [req("r2", 0, 8, 1), req("r10", 0, 8, 1), req("r1", 0, 8, 1)]
    reqs[2].priority = -1
    got = steps(reqs, scheduling="priority", max_num_seqs=1, num_gpu_blocks=20)
    assert {k: v[0] for k, v in got.items()} == {"r1": 0, "r10": 1, "r2": 2}


def test_step_time_runs_queue_session_turns_at_their_arrival():
    # closed-loop sessions would hold turn 2 until turn 1 finished (step 4) plus its think
    # time; a step-time run is open loop, as the comparison with vLLM needs
    t1 = req("t1", 0, 8, 5)
    t2 = req("t2", 1, 8, 1)
    for r in (t1, t2):
        r.session, r.think_time = "s", 10.0
    got = steps([t1, t2], num_gpu_blocks=20, closed_loop_sessions=True)
    assert got == {"t1": (0, 0, 4, 0), "t2": (1, 1, 1, 0)}


@pytest.mark.parametrize("active,late", [(2, (3, 3, 5, 0)), (None, (0, 0, 2, 0))])
def test_max_num_active_seqs_caps_admissions_below_max_num_seqs(active, late):
    # vLLM 0.31+ (0.33: `if num_running >= self.max_num_active_reqs: break` in the WAITING loop,
    # max_num_active_reqs = SchedulerConfig.max_num_active_seqs or max_num_seqs): with 2 of 4,
    # c and d wait for a and b to finish at step 2
    got = steps([req(x, 0, 4, 3) for x in "abcd"], num_gpu_blocks=100, max_num_batched_tokens=64,
                max_num_seqs=4, max_num_active_seqs=active)
    assert got == {"a": (0, 0, 2, 0), "b": (0, 0, 2, 0), "c": late, "d": late}


@pytest.mark.parametrize("adaptive,first_token", [(True, 3), (False, 12)])
def test_an_adaptive_long_prefill_cap_is_floored_at_a_fair_share_of_the_budget(adaptive, first_token):
    # vLLM 0.31+ (long_prefill_token_threshold_adaptive): the cap is max(8, 64 // 2 requests) = 32,
    # so each 100-token prompt takes 32 + 32 + 32 + 4 tokens (first token at step 3), not 8 a step
    got = steps([req("a", 0, 100, 1), req("b", 0, 100, 1)], num_gpu_blocks=60, max_num_batched_tokens=64,
                long_prefill_token_threshold=8, long_prefill_token_threshold_adaptive=adaptive)
    assert got == {x: (0, first_token, first_token, 0) for x in "ab"}


@pytest.mark.parametrize("reserve,b", [(True, (20, 22, 22, 0)), (False, (1, 22, 22, 1))])
def test_without_the_full_isl_reserve_a_first_chunk_is_enough_to_be_admitted(reserve, b):
    # KVCacheManager.allocate_slots(full_sequence_must_fit=SchedulerConfig.scheduler_reserve_full_isl):
    # 7 usable blocks, a holds 3 at step 1. b's 20 tokens need 5 blocks: with the reserve b
    # waits for a to finish (step 19); without it b's 7-token chunk takes 2 blocks at once,
    # is preempted as a grows, and finishes no sooner
    got = steps([req("a", 0, 8, 20), req("b", 0.5, 20, 1)], num_gpu_blocks=8, max_num_batched_tokens=8,
                max_num_seqs=2, scheduler_reserve_full_isl=reserve)
    assert got == {"a": (0, 0, 19, 0), "b": b}


@pytest.mark.parametrize("scheduled,want", [
    (16, {"a": (0, 6, 6, 0), "b": (6, 12, 12, 0), "c": (12, 13, 15, 0)}),
    (None, {"a": (0, 1, 1, 0), "b": (1, 3, 3, 0), "c": (3, 3, 5, 0)}),
])
def test_max_num_scheduled_tokens_is_the_step_budget(scheduled, want):
    # vllm/v1/core/sched/scheduler.py Scheduler.schedule (0.33): token_budget starts at
    # max_num_scheduled_tokens (Scheduler.__init__; max_num_batched_tokens when unset). At 16 a
    # step, a's 100-token prompt takes steps 0-6 and b waits behind it; at 64, two steps
    got = steps([req("a", 0, 100, 1), req("b", 0, 100, 1), req("c", 2.5, 10, 3)], num_gpu_blocks=100,
                max_num_seqs=4, max_num_batched_tokens=64, max_num_scheduled_tokens=scheduled)
    assert got == want


def test_the_adaptive_long_prefill_floor_divides_max_num_batched_tokens():
    # Scheduler.schedule (0.33): the floor is input_budget (max_num_batched_tokens) // 2 requests
    # = 32, not the step budget of 48 // 2: a takes 32 a step, b the 16 left (first tokens 3, 4)
    got = steps([req("a", 0, 100, 1), req("b", 0, 100, 1)], num_gpu_blocks=60, max_num_seqs=4,
                max_num_batched_tokens=64, max_num_scheduled_tokens=48, long_prefill_token_threshold=8,
                long_prefill_token_threshold_adaptive=True)
    assert got == {"a": (0, 3, 3, 0), "b": (0, 4, 4, 0)}


def test_max_num_scheduled_tokens_outside_what_kvsim_models_is_refused():
    from kvsim.sim.engine.config import ConfigError

    with pytest.raises(ConfigError, match=r"max_num_scheduled_tokens \(65\) must be <= max_num_batched_tokens \(64\)"):
        SimConfig(max_num_seqs=4, max_num_batched_tokens=64, max_num_scheduled_tokens=65).validate()
    with pytest.raises(ConfigError, match="needs chunked prefill"):
        SimConfig(max_num_seqs=4, max_num_batched_tokens=64, max_num_scheduled_tokens=32,
                  enable_chunked_prefill=False).validate()
    with pytest.raises(ConfigError, match=r"max_num_scheduled_tokens must be >= 1, got 0"):
        SimConfig(max_num_scheduled_tokens=0).validate()


def test_a_step_budget_below_max_num_seqs_cuts_decodes_in_running_order():
    # Scheduler.schedule (0.33): the RUNNING loop hands the 2-token budget out in order and
    # admissions get what is left. a's prompt takes step 0; from step 1 a decodes and b's prompt
    # takes the other token (two steps); a and b then spend the budget, so c is admitted only
    # once a finishes (step 5). kvsim's lazy decodes, which assume every running decode fits,
    # are off here (Shortcuts decodes_fit); the same steps with the shortcuts off, and in vLLM
    reqs = [req("a", 0, 2, 6), req("b", 0, 2, 6), req("c", 0, 2, 6)]
    want = {"a": (0, 0, 5, 0), "b": (1, 2, 7, 0), "c": (6, 7, 12, 0)}
    for shortcuts in (True, False):
        assert steps(reqs, num_gpu_blocks=40, max_num_seqs=4, max_num_batched_tokens=8, max_num_scheduled_tokens=2,
                     shortcuts=shortcuts) == want


def test_the_admission_knobs_need_a_release_that_has_them():
    from kvsim.sim.engine.config import ConfigError

    with pytest.raises(ConfigError, match=r"vLLM 0.30 has no max_num_active_seqs \(it came in 0.31\)"):
        SimConfig(max_num_active_seqs=2, vllm_version="0.30").validate()
    with pytest.raises(ConfigError, match=r"vLLM 0.28 has no long_prefill_token_threshold_adaptive"):
        SimConfig(long_prefill_token_threshold_adaptive=True, vllm_version="0.28").validate()
    with pytest.raises(ConfigError, match=r"vLLM 0.23 has no prefill_schedule_interval \(it came in 0.24\)"):
        SimConfig(prefill_schedule_interval=2, vllm_version="0.23").validate()
    with pytest.raises(ConfigError, match="prefill_schedule_interval needs preemption=.recompute."):
        SimConfig(prefill_schedule_interval=2, preemption="swap", num_cpu_blocks=8).validate()
    with pytest.raises(ConfigError, match=r"max_num_active_seqs \(9\) must be <= max_num_seqs \(8\)"):
        SimConfig(max_num_seqs=8, max_num_active_seqs=9).validate()


def _cadence_case():
    return [req("a", 0, 4, 12), req("b", 0.5, 4, 2), req("c", 3.5, 4, 1)]


@pytest.mark.parametrize("interval,version,b,c", [(3, "0.33", (3, 3, 4, 0), (6, 6, 6, 0)),
                                                  (1, "0.33", (1, 1, 2, 0), (4, 4, 4, 0)),
                                                  (3, "0.32", (1, 1, 2, 0), (4, 4, 4, 0))])
def test_the_prefill_cadence_admits_prompts_once_every_interval(interval, version, b, c):
    # vLLM 0.33 Scheduler.schedule, local prefill cadence (prefill_schedule_interval, no data
    # parallelism): a's prefill is executed step 1; steps 1 and 2 hold b back (fewer than 3
    # executed steps since, and a decodes); step 3 admits it and restarts the interval, so c,
    # queued before step 4, waits for step 6. vLLM 0.32 paced only data-parallel engines.
    got = steps(_cadence_case(), num_gpu_blocks=100, max_num_batched_tokens=64,
                prefill_schedule_interval=interval, vllm_version=version)
    assert got == {"a": (0, 0, 11, 0), "b": b, "c": c}


def test_the_prefill_cadence_holds_a_running_chunk_and_lets_a_backlog_through():
    # a held step skips a running request mid-prefill: d's second 36 tokens wait for step 6
    got = steps([req("a", 0, 4, 12), req("d", 0.5, 100, 1)], num_gpu_blocks=100, max_num_batched_tokens=64,
                prefill_schedule_interval=3)
    assert got == {"a": (0, 0, 11, 0), "d": (3, 6, 6, 0)}
    # a release that leaves requests waiting (2 active: c cannot join at step 3) marks the
    # engine capacity-bound (prefill_capacity_bound), and steps stop holding: c joins at step 6,
    # as soon as b is done, and e at step 9
    got = steps([req("a", 0, 4, 12), req("b", 0.5, 4, 3), req("c", 0.5, 4, 3), req("e", 4.5, 4, 1)],
                num_gpu_blocks=100, max_num_batched_tokens=64, max_num_seqs=3, max_num_active_seqs=2,
                prefill_schedule_interval=3)
    assert got == {"a": (0, 0, 11, 0), "b": (3, 3, 5, 0), "c": (6, 6, 8, 0), "e": (9, 9, 9, 0)}
