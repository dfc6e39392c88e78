"""Quiet runs (sim.engine.quiet): the steps taken in their own loop give exactly the tables of plain stepping."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvsim.sim.engine.quiet as quiet
from kvsim.sim.engine.config import SimConfig
from kvsim.sim.engine.cost_model import CostModel
from kvsim.sim.engine.run import RunResult, simulate
from kvsim.workloads.build import build_workload
from kvsim.workloads.request import Workload
from tests.sim.engine.engine_fixtures import GROUPS, WINDOW_MODELS, FlatCost, req

SHAPES: dict[str, dict[str, Any]] = {  # small requests, so a few dozen fill a small cache
    "shared-prefix": {"prefix_len": "fixed:48", "user_len": "lognormal:24,1.0", "output_len": "lognormal:40,1.0",
                      "num_prefixes": 2},
    "multi-turn": {"prefix_len": "fixed:32", "user_len": "lognormal:16,0.5", "output_len": "lognormal:30,1.0",
                   "turns": "uniform:2,4", "think_time": 0.5},
    "agent": {"prefix_len": "fixed:40", "user_len": "lognormal:12,0.5", "output_len": "lognormal:20,0.5",
              "turns": "uniform:2,3", "think_time": 0.2},
    "parallel": {"user_len": "lognormal:40,0.5", "output_len": "lognormal:30,0.5", "samples": 2},
    "unique": {"user_len": "lognormal:60,1.0", "output_len": "lognormal:50,1.0"},
}


def built(monkeypatch: pytest.MonkeyPatch, runs: type) -> list:
    """Collect every run loop of class `runs` (`QuietRuns`, `AsyncQuietRuns`) the engine builds, to
    count the steps they take."""
    made: list = []
    build = runs.build.__func__

    def spy(cls, *args, **kw):
        q = build(cls, *args, **kw)
        if q is not None:
            made.append(q)
        return q

    monkeypatch.setattr(runs, "build", classmethod(spy))
    return made


def _taken(monkeypatch: pytest.MonkeyPatch) -> list[quiet.QuietRuns]:
    return built(monkeypatch, quiet.QuietRuns)


def _same(fast: RunResult, slow: RunResult) -> None:
    pd.testing.assert_frame_equal(fast.steps, slow.steps)
    pd.testing.assert_frame_equal(fast.requests, slow.requests)
    assert fast.summary.keys() == slow.summary.keys()
    for k, v in fast.summary.items():  # NaN == NaN here
        assert v == slow.summary[k] or (v != v and slow.summary[k] != slow.summary[k]), k
    assert fast.manager.ops.counts == slow.manager.ops.counts
    if fast.group_usage is not None or slow.group_usage is not None:  # vLLM's hybrid groups: a row a step
        pd.testing.assert_frame_equal(fast.group_usage, slow.group_usage)


def _run(kind: str, seed: int, rate: float, cfg: SimConfig, real_cost: bool) -> RunResult:
    wl = build_workload(kind, 30, rate, "poisson", 1.0, seed, dict(SHAPES[kind]))
    cost = CostModel.from_config(cfg) if real_cost else FlatCost(0.05)
    return simulate(wl, cfg, cost_model=cost)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    kind=st.sampled_from(sorted(SHAPES)),
    seed=st.integers(0, 10_000),
    rate=st.sampled_from([2.0, 20.0, 200.0]),
    block_size=st.sampled_from([1, 2, 4, 8, 16]),
    num_gpu_blocks=st.integers(12, 160),
    budget=st.sampled_from([32, 64, 512]),
    max_seqs=st.sampled_from([4, 16, 32]),
    eviction=st.sampled_from(["lru", "arc", "s3fifo", "fifo", "lfu", "cost", "pinned"]),
    caching=st.booleans(),
    chunked=st.booleans(),
    watermark=st.sampled_from([0.0, 0.05]),
    real_cost=st.booleans(),
    closed=st.booleans(),
    active=st.sampled_from([None, 1, 3]),
    long_prefill=st.sampled_from([0, 0, 8]),
    adaptive=st.booleans(),
    reserve=st.sampled_from([True, True, False]),
    interval=st.sampled_from([1, 1, 3]),
    scheduled=st.sampled_from([None, None, 0, 1]),
)
def test_quiet_runs_change_nothing(kind: str, seed: int, rate: float, block_size: int, num_gpu_blocks: int,
                                   budget: int, max_seqs: int, eviction: str, caching: bool, chunked: bool,
                                   watermark: float, real_cost: bool, closed: bool, active: int | None,
                                   long_prefill: int, adaptive: bool, reserve: bool, interval: int,
                                   scheduled: int | None) -> None:
    """Steps, requests, summary and op counts are identical with the shortcuts on and off,
    over random workloads and configurations (vLLM 0.31+'s admission knobs, 0.33's prefill
    cadence, a step budget at max_num_seqs (`scheduled` 0) or below it (1) too), with a flat
    and the roofline cost model."""
    cfg = SimConfig(model="llama-3-8b", gpu="h100-sxm", block_size=block_size, num_gpu_blocks=num_gpu_blocks,
                    max_num_batched_tokens=max(budget, max_seqs), max_num_seqs=max_seqs, eviction=eviction,
                    enable_prefix_caching=caching, enable_chunked_prefill=chunked, watermark=watermark,
                    closed_loop_sessions=closed, max_num_active_seqs=None if active is None else min(active, max_seqs),
                    long_prefill_token_threshold=long_prefill, long_prefill_token_threshold_adaptive=adaptive,
                    scheduler_reserve_full_isl=reserve, prefill_schedule_interval=interval,
                    max_num_scheduled_tokens=None if scheduled is None or not chunked else max_seqs >> scheduled,
                    async_scheduling=False)
    fast = _run(kind, seed, rate, cfg, real_cost)
    slow = _run(kind, seed, rate, cfg.replace(shortcuts=False), real_cost)
    _same(fast, slow)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    kind=st.sampled_from(sorted(SHAPES)),
    seed=st.integers(0, 10_000),
    rate=st.sampled_from([2.0, 20.0, 200.0]),  # (2: steps of lazy decodes alone, `Shortcuts.lazy_step`)
    block_size=st.sampled_from([4, 8, 16]),
    num_gpu_blocks=st.integers(12, 120),
    budget=st.sampled_from([32, 64, 512]),
    max_seqs=st.sampled_from([4, 16, 32]),
    eviction=st.sampled_from(["lru", "arc", "s3fifo"]),
    caching=st.booleans(),
    watermark=st.sampled_from([0.0, 0.05]),
    model=st.sampled_from([None, *WINDOW_MODELS]),
    real_cost=st.booleans(),
)
def test_async_output_gives_the_same_tables_with_the_blocked_head_skip_on_and_off(
        window_models, kind: str, seed: int, rate: float, block_size: int, num_gpu_blocks: int, budget: int,
        max_seqs: int, eviction: str, caching: bool, watermark: float, model, real_cost: bool) -> None:
    """Under async output the shortcuts are the blocked-head skip (whether a head's retry fails is the
    manager's state, whichever output mode applies the steps) and, over one group, the async output's
    own lazy decodes (`AsyncLazy`). Every table is the same with them on and off, over one group and
    vLLM's hybrid groups (small windows that move)."""
    groups = {"model": "llama-3-8b"} if model is None else \
        {"model": window_models[model], "prefix_cache_retention_interval": 0}
    blocks = num_gpu_blocks * (1 if model is None else GROUPS[model[1]])
    cfg = SimConfig(**groups, gpu="h100-sxm", block_size=block_size, num_gpu_blocks=blocks,
                    max_num_batched_tokens=max(budget, max_seqs), max_num_seqs=max_seqs, eviction=eviction,
                    enable_prefix_caching=caching, watermark=watermark, async_scheduling=True)
    _same(_run(kind, seed, rate, cfg, real_cost), _run(kind, seed, rate, cfg.replace(shortcuts=False), real_cost))


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    kind=st.sampled_from(["unique", "parallel", "multi-turn"]),
    seed=st.integers(0, 10_000),
    block_size=st.sampled_from([4, 8]),
    window=st.sampled_from([8, 16, 32]),
    retention=st.sampled_from([0, 8, None]),
    num_gpu_blocks=st.integers(40, 120),
)
def test_async_output_over_one_groups_window_gives_the_same_tables_with_the_shortcuts_on_and_off(
        kind: str, seed: int, block_size: int, window: int, retention: int | None, num_gpu_blocks: int) -> None:
    """One group's sliding window of whole blocks under async output (its own lazy decodes on): the
    window frees the blocks it slides past while their sequence runs, cached or not as plain stepping
    cached them, so no cache may wait for the sequence's end there (`defer_unique_caching` is off);
    decoded tokens past the known ones (`unique`) fill blocks that retention hashes."""
    cfg = SimConfig(model="llama-3-8b", gpu="h100-sxm", block_size=block_size, num_gpu_blocks=num_gpu_blocks,
                    max_num_batched_tokens=64, max_num_seqs=16, sliding_window=window,
                    prefix_cache_retention_interval=retention, async_scheduling=True)
    _same(_run(kind, seed, 50.0, cfg, False), _run(kind, seed, 50.0, cfg.replace(shortcuts=False), False))


def test_async_output_skips_a_blocked_heads_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """The skip above is not idle: on a tight cache under async output it answers for the head many
    times (each a lookup and an allocation plain stepping makes and sees fail), and changes nothing."""
    from kvsim.sim.engine import shortcuts

    skipped = []
    still = shortcuts.BlockedHead.still

    def spy(self, live, budget, watermark):
        out = still(self, live, budget, watermark)
        skipped.append(out)
        return out

    monkeypatch.setattr(shortcuts.BlockedHead, "still", spy)
    cfg = SimConfig(block_size=4, num_gpu_blocks=60, max_num_batched_tokens=256, max_num_seqs=16,
                    async_scheduling=True)
    fast = _run("unique", 7, 200.0, cfg, True)
    assert sum(skipped) == 1018
    _same(fast, _run("unique", 7, 200.0, cfg.replace(shortcuts=False), True))


def _spy_async_lazy(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Count what the async output's lazy decodes do: sequences going lazy, brought up to date in the
    batch in flight (`drop` after at least one lazy step), preempted while lazy, and all of them
    brought up to date because the step budget binds (`materialize`)."""
    from kvsim.sim.engine import shortcuts

    seen = {"lazy": 0, "joined": 0, "preempted": 0, "materialized": 0}
    add, drop, pre, mat = (shortcuts.AsyncLazy.add, shortcuts.AsyncLazy.drop, shortcuts.Shortcuts.preempted,
                           shortcuts.Shortcuts.materialize)

    def add_spy(self, *args):
        seen["lazy"] += 1
        return add(self, *args)

    def drop_spy(self, live, k):
        seen["joined"] += k > live.since
        return drop(self, live, k)

    def pre_spy(self, live, k):
        seen["preempted"] += live.since >= 0
        return pre(self, live, k)

    def mat_spy(self, running, k):
        seen["materialized"] += self.lazy.n > 0
        return mat(self, running, k)

    monkeypatch.setattr(shortcuts.AsyncLazy, "add", add_spy)
    monkeypatch.setattr(shortcuts.AsyncLazy, "drop", drop_spy)
    monkeypatch.setattr(shortcuts.Shortcuts, "preempted", pre_spy)
    monkeypatch.setattr(shortcuts.Shortcuts, "materialize", mat_spy)
    return seen


def test_async_output_decodes_lazily_and_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The async output's lazy decodes (`AsyncLazy`) on a tight cache: sequences go lazy 191
    times, rejoin the batch in flight when due, and some are preempted while lazy (brought up to date
    first); every table is plain stepping's."""
    seen = _spy_async_lazy(monkeypatch)
    cfg = SimConfig(block_size=4, num_gpu_blocks=120, max_num_batched_tokens=64, max_num_seqs=32,
                    async_scheduling=True)
    fast = _run("multi-turn", 7, 50.0, cfg, False)
    assert seen == {"lazy": 191, "joined": 190, "preempted": 3, "materialized": 0}
    _same(fast, _run("multi-turn", 7, 50.0, cfg.replace(shortcuts=False), False))


def test_async_output_brings_lazy_decodes_up_to_date_when_the_budget_binds(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long prompt admitted first takes 16-token chunks while two short requests behind it in
    RUNNING decode lazily; a step whose budget (32 tokens) cannot give the prompt its chunk after them
    brings every lazy one up to date (vLLM hands the budget out in RUNNING order)."""
    seen = _spy_async_lazy(monkeypatch)
    reqs = [req("long", 0.0, 300, 40), req("short", 0.5, 6, 60), req("short2", 0.7, 5, 50)]
    cfg = SimConfig(block_size=4, num_gpu_blocks=200, max_num_batched_tokens=32, max_num_seqs=8,
                    long_prefill_token_threshold=16, async_scheduling=True)
    fast = simulate(Workload.from_list(reqs, "t"), cfg, cost_model=FlatCost(1.0))
    assert seen == {"lazy": 44, "joined": 30, "preempted": 0, "materialized": 10}
    _same(fast, simulate(Workload.from_list(reqs, "t"), cfg.replace(shortcuts=False), cost_model=FlatCost(1.0)))


@pytest.mark.parametrize("eviction", ["lru", "fifo", "lfu", "cost", "pinned", "arc", "s3fifo"])
def test_every_eviction_policy_gives_the_same_tables(eviction: str) -> None:
    """A block of unique decoded tokens may fill lazily and be cached a step or more late, which
    no lookup can tell; but FIFO's birth order and ARC's ghost lists see when blocks are cached,
    so under a policy that hooks caching every cache stays in its step. Both cases below differed
    under FIFO and ARC before that rule."""
    for kind, seed in (("parallel", 0), ("unique", 1)):
        cfg = SimConfig(model="llama-3-8b", gpu="h100-sxm", block_size=8, num_gpu_blocks=30,
                        max_num_batched_tokens=64, max_num_seqs=16, eviction=eviction, async_scheduling=False)
        _same(_run(kind, seed, 20.0, cfg, False), _run(kind, seed, 20.0, cfg.replace(shortcuts=False), False))


@pytest.mark.parametrize("kind", sorted(SHAPES))
def test_most_steps_of_a_loaded_engine_are_quiet(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """A cache a few requests fill: quiet runs take many steps, and change nothing."""
    made = _taken(monkeypatch)
    cfg = SimConfig(block_size=4, num_gpu_blocks=60, max_num_batched_tokens=256, max_num_seqs=16,
                    async_scheduling=False)
    fast = _run(kind, 7, 50.0, cfg, True)
    assert len(made) == 1 and made[0].taken > len(fast.steps) // 4
    _same(fast, _run(kind, 7, 50.0, cfg.replace(shortcuts=False), True))


@pytest.mark.parametrize("extra", [{"defrag_threshold": 4}, {"debug_invariants": True},
                                   {"step_time": 0.05}, {"scheduling": "priority"}, {"num_lookahead_tokens": 2},
                                   {"async_scheduling": True}, {"kv_offloading_size": 0.001}])
def test_quiet_runs_stay_off_where_the_general_step_is_needed(monkeypatch: pytest.MonkeyPatch,
                                                             extra: dict[str, Any]) -> None:
    made = _taken(monkeypatch)
    cfg = SimConfig(block_size=4, num_gpu_blocks=60, max_num_batched_tokens=256, max_num_seqs=16,
                    **{"async_scheduling": False, **extra})  # sync, where quiet runs are taken, unless async
    _run("unique", 3, 50.0, cfg, True)
    assert made == []


def test_a_decode_caching_the_blocked_heads_next_key_ends_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """b's prompt repeats a's known answer: as a decodes it, the blocks b lacks get cached, and
    b, blocked, is admitted at the step after the one that cached its next key (4 s, 12 tokens
    hit); a quiet run that missed this would have kept b waiting until 27 s."""
    prompt, answer = np.arange(100, 108), np.arange(500, 524)
    reqs = [req("a", 0, prompt, 24, output=answer), req("c", 0, 16, 20),
            req("b", 1.5, np.concatenate([prompt, answer, np.arange(900, 908)]), 4)]
    cfg = SimConfig(block_size=4, num_gpu_blocks=16, max_num_batched_tokens=64, max_num_seqs=8, async_scheduling=False)

    def go(c: SimConfig) -> RunResult:
        return simulate(Workload.from_list(reqs, "t"), c, cost_model=FlatCost(1.0))

    made = _taken(monkeypatch)
    fast = go(cfg)
    assert made[0].taken > 0
    assert fast.requests[["first_scheduled", "hit_tokens"]].values.tolist()[2] == [4.0, 12]
    _same(fast, go(cfg.replace(shortcuts=False)))
    monkeypatch.setattr(quiet.QuietRuns, "_caches", lambda *_: False)
    assert go(cfg).requests["first_scheduled"].tolist()[2] == 27.0


def test_a_finish_is_a_quiet_step_and_the_blocked_head_is_decided_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """a, b and c run from step 0; d arrives at 0.5 s and waits for blocks until c is done.
    a, b and c finish inside quiet runs (steps 10, 20, 30: their blocks free once the step is
    done, as `SyncOutput.update` frees them); each finish ends its run, and the general step
    after it retries d: it fails at steps 11 and 21, and admits d at step 31, where plain
    stepping does. General steps: 0 (prefill), 1 (d's first try), 11, 21 and 31."""
    reqs = [req("a", 0, 8, 11), req("b", 0, 8, 21), req("c", 0, 8, 31), req("d", 0.5, 64, 4)]
    cfg = SimConfig(block_size=4, num_gpu_blocks=24, max_num_batched_tokens=128, max_num_seqs=8, async_scheduling=False)

    def go(c: SimConfig) -> RunResult:
        return simulate(Workload.from_list(reqs, "t"), c, cost_model=FlatCost(1.0))

    made = _taken(monkeypatch)
    fast = go(cfg)
    _same(fast, go(cfg.replace(shortcuts=False)))
    steps = fast.steps
    assert steps.index[steps["finished"] == 1].tolist() == [10, 20, 30, 34]
    assert steps.index[steps["admitted"] == 1].tolist() == [31]
    assert steps["running"].tolist()[9:12] == [3, 2, 2] and steps["scheduled_seqs"].tolist()[9:12] == [3, 3, 2]
    assert len(steps) == 35 and made[0].taken == 30


def test_without_the_full_isl_reserve_a_blocked_head_is_retried_every_step() -> None:
    """`BlockedHead` reckons with the whole known context, the reserve's gate; without it a head
    may fit its chunk sooner, so the skip is off (with it on, 7 of these 120 requests were
    admitted later than plain stepping admits them)."""
    from pathlib import Path

    from kvsim.workloads.traces import load_workload

    golden = Path(__file__).resolve().parents[2] / "golden" / "workloads" / "multi-turn.jsonl"
    cfg = SimConfig(block_size=16, step_time=0.05, closed_loop_sessions=False, num_gpu_blocks=60,
                    max_num_batched_tokens=256, scheduler_reserve_full_isl=False, async_scheduling=False)

    def go(c: SimConfig) -> RunResult:
        return simulate(load_workload(golden), c)

    _same(go(cfg), go(cfg.replace(shortcuts=False)))


def test_the_prefill_cadence_sees_a_resumed_sequence_end_its_prefill_in_a_decode() -> None:
    """A preempted sequence resumed in chunks may end its prefill with a one-token chunk, which
    the decode shortcut takes: that step still carries prefill (vLLM is_prefill_chunk), so the
    cadence restarts there. A random conformance case (seed 32513) found 8 of its 20 requests
    scheduled later than vLLM schedules them when the shortcut missed it. (Since random cases draw
    models in vLLM's hybrid KV-cache groups, the seed runs gpt-oss-20b's two groups: the rule is the
    scheduler's, and the groups' lazy decodes must see it too.)"""
    from kvsim.sim.conform.random_cases import random_case

    case = random_case(32513)

    def go(c: SimConfig) -> RunResult:
        return simulate(Workload.from_list(case.requests, "t"), c)

    _same(go(case.cfg), go(case.cfg.replace(shortcuts=False)))


HYBRID_SHAPES: dict[str, dict[str, Any]] = {  # prompts and answers long enough for a 32-token window to move
    "multi-turn": {"prefix_len": "fixed:64", "user_len": "lognormal:48,0.5", "output_len": "lognormal:60,0.8",
                   "turns": "uniform:2,3", "think_time": 0.5},
    "shared-prefix": {"prefix_len": "fixed:96", "user_len": "lognormal:40,1.0", "output_len": "lognormal:70,1.0",
                      "num_prefixes": 2},
    "unique": {"user_len": "lognormal:90,1.0", "output_len": "lognormal:80,1.0"},
}


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    kind=st.sampled_from(sorted(HYBRID_SHAPES)),
    seed=st.integers(0, 10_000),
    rate=st.sampled_from([5.0, 50.0]),
    model=st.sampled_from(WINDOW_MODELS),
    num_gpu_blocks=st.integers(40, 200),
    budget=st.sampled_from([64, 256]),
    max_seqs=st.sampled_from([4, 16]),
    caching=st.booleans(),
    retention=st.sampled_from([0, None]),
    watermark=st.sampled_from([0.0, 0.05]),
    closed=st.booleans(),
)
def test_quiet_runs_of_hybrid_groups_change_nothing(window_models, kind: str, seed: int, rate: float,
                                                    model: tuple[int, str], num_gpu_blocks: int, budget: int,
                                                    max_seqs: int, caching: bool, retention: int | None,
                                                    watermark: float, closed: bool) -> None:
    """vLLM's hybrid groups (a sliding window and full attention over one pool): a decode may let a
    window's blocks go at any slot and takes a block in every group at a block's first, so quiet
    steps visit each sequence through the manager and end where blocks let go could unblock the
    waiting head. Same tables with the shortcuts on and off."""
    cfg = SimConfig(model=window_models[model], gpu="h100-sxm", num_gpu_blocks=num_gpu_blocks,
                    max_num_batched_tokens=max(budget, max_seqs), max_num_seqs=max_seqs,
                    enable_prefix_caching=caching, watermark=watermark, closed_loop_sessions=closed,
                    prefix_cache_retention_interval=retention if caching else 0, async_scheduling=False)
    wl = build_workload(kind, 24, rate, "poisson", 1.0, seed, dict(HYBRID_SHAPES[kind]))
    fast, slow = simulate(wl, cfg), simulate(wl, cfg.replace(shortcuts=False))
    assert fast.manager.num_groups == GROUPS[model[1]]
    _same(fast, slow)


def test_a_hybrid_models_decodes_run_quiet(monkeypatch: pytest.MonkeyPatch, window_models) -> None:
    """The quiet runs are built for vLLM's hybrid groups (not with Mamba state) and take most steps
    of a decode-heavy load, with the same tables."""
    made = _taken(monkeypatch)
    cfg = SimConfig(model=window_models[32, "gemma-3-12b"], gpu="h100-sxm", num_gpu_blocks=400,
                    max_num_batched_tokens=256, max_num_seqs=16, async_scheduling=False)
    wl = build_workload("unique", 30, 20.0, "poisson", 1.0, 5, dict(HYBRID_SHAPES["unique"]))
    fast = simulate(wl, cfg)
    assert fast.manager.num_groups == 6 and fast.manager.freed_behind[0] > 0  # the window moved
    assert len(made) == 1 and made[0].taken > len(fast.steps) // 4
    _same(fast, simulate(wl, cfg.replace(shortcuts=False)))


@pytest.mark.parametrize("kind", ["unique", "multi-turn", "parallel"])
def test_quiet_runs_record_the_plain_ops(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """With op records (one group) quiet steps stamp their ops with their step and record each
    visit's write as `Shortcuts.decode` does (a lazy run's late, when woken): most steps are quiet,
    and every step has the ops of plain stepping, each block seeing them in the same order."""
    from tests.sim.engine.test_record_ops import same_stream

    made = _taken(monkeypatch)
    cfg = SimConfig(block_size=4, num_gpu_blocks=60, max_num_batched_tokens=256, max_num_seqs=16, record_ops=True,
                    async_scheduling=False)
    fast = _run(kind, 7, 50.0, cfg, True)
    assert len(made) == 1 and made[0].taken > len(fast.steps) // 4
    slow = _run(kind, 7, 50.0, cfg.replace(shortcuts=False), True)
    _same(fast, slow)
    a, b = fast.manager.ops.records(), slow.manager.ops.records()
    assert len(a) == len(b) == fast.manager.ops.counts.total()
    same_stream(a, b)


def test_async_output_visits_a_chunked_local_groups_let_go(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under async output a group lets go on the processed tokens, one behind the computed ones: a
    window of whole blocks at a block's first slot (visited), but Llama 4's 8,192-token chunks (vLLM's
    hybrid groups with chunked local attention) at a block's second slot, which a lazy decode would
    skip (its free-block counts then differ from plain stepping's). So the async output's lazy decodes
    stay off there (`async_decode_shortcuts`), and on over windows (gpt-oss-20b's 128 tokens)."""
    seen = _spy_async_lazy(monkeypatch)
    reqs = [req(f"r{i}", 0.01 * i, 8150 + 7 * i, 120 + i) for i in range(12)]  # decodes across 8,192
    for model, groups in (("llama-4-scout", {"tensor_parallel": 4, "hybrid_chunked_local": True}),
                          ("gpt-oss-20b", {})):
        cfg = SimConfig(model=model, gpu="h100-sxm", num_gpu_blocks=20000, async_scheduling=True, **groups)
        fast = simulate(Workload.from_list(reqs, "t"), cfg)
        _same(fast, simulate(Workload.from_list(reqs, "t"), cfg.replace(shortcuts=False)))
        assert (model, seen["lazy"]) == {"llama-4-scout": (model, 0), "gpt-oss-20b": (model, 103)}[model]


def _long_decodes(seed: int, output: int) -> Workload:
    """Shared prefixes and fanned-out samples whose decodes cross Qwen3-Next's 144- and 192-token blocks."""
    from kvsim.workloads.arrivals import Poisson
    from kvsim.workloads.lengths import Fixed, LogNormal
    from kvsim.workloads.shapes import merge, parallel, shared_prefix

    a = shared_prefix(40, num_prefixes=3, prefix_len=Fixed(400), user_len=LogNormal(200, 1.0, hi=900),
                      output_len=LogNormal(output, 1.0, hi=3 * output), arrivals=Poisson(4.0), seed=seed,
                      token_range=(0, 2**20))
    b = parallel(8, n=2, prompt_len=LogNormal(300, 0.5, hi=900), output_len=LogNormal(output, 0.5, hi=3 * output),
                 arrivals=Poisson(2.0), seed=seed + 1, token_range=(2**20, 2**21))
    return merge(a, b, name="long-decodes")


@pytest.mark.parametrize(("gpu", "budget", "group_blocks", "output", "max_seqs", "counts"),
                         [("h100-sxm", 512, 6, 300, 8, (138, 26, 521)),
                          ("h100-sxm", 2048, 40, 900, 32, (316, 38, 3014)),
                          ("a100-80g", 1024, 8, 900, 8, (416, 242, 1008))])
def test_async_output_decodes_lazily_beside_mamba_groups(monkeypatch: pytest.MonkeyPatch, gpu: str, budget: int,
                                                         group_blocks: int, output: int, max_seqs: int,
                                                         counts: tuple[int, int, int]) -> None:
    """Qwen3-Next's gated-delta-net groups under async output: vLLM 0.33 lets a request's blocks go on
    its processed tokens, the computed ones less those in flight (vllm/v1/core/kv_cache_manager.py
    `KVCacheManager.allocate_slots` calls `remove_skipped_blocks` with `total_computed_tokens -
    request.num_in_flight_tokens`), and `MambaManager.remove_skipped_blocks`
    (single_type_kv_cache_manager.py) frees the previous state once those pass a block's first
    token: at the decode of a block's third slot, one token later than under sync output. That
    decode is visited, and the sequence decodes lazily after it to the block's end; the steps of
    lazy decodes alone run in the async quiet loop. Tables, summary and per-group usage are plain
    stepping's, under preemption. (Going lazy at a block's first slot instead frees the previous
    state a block late, and the tables differ.) `counts`: sequences brought up to date from lazy
    decoding, preemptions, and steps the quiet loop took."""
    from kvsim.sim.engine import async_quiet, shortcuts

    drops, made = [], built(monkeypatch, async_quiet.AsyncQuietRuns)
    drop = shortcuts.AsyncLazy.drop
    monkeypatch.setattr(shortcuts.AsyncLazy, "drop", lambda lazies, live, k: (drops.append(k), drop(lazies, live, k)))
    cfg = SimConfig(model="qwen3-next-80b-a3b", tensor_parallel=8, gpu=gpu, max_num_batched_tokens=budget,
                    max_num_seqs=max_seqs, async_scheduling=True)
    cfg = cfg.replace(num_gpu_blocks=group_blocks * len(CostModel.from_config(cfg).layout.groups))
    fast = simulate(_long_decodes(1, output), cfg)
    assert (len(drops), fast.summary["preemptions"], sum(q.taken for q in made)) == counts
    assert fast.manager.has_mamba and fast.manager.block_size in (144, 192)
    _same(fast, simulate(_long_decodes(1, output), cfg.replace(shortcuts=False)))


@pytest.mark.parametrize("window, lazy", [(32, 150), (30, 0)])
def test_async_output_decodes_lazily_beside_one_groups_window_of_whole_blocks(
        monkeypatch: pytest.MonkeyPatch, window: int, lazy: int) -> None:
    """One group's sliding window under async output lets go on the processed tokens, one behind the
    computed ones: a window of whole blocks at a block's first slot, which is visited, so lazy decodes
    run beside it (`KVCacheManager.async_decode_shortcuts`); any other window lets go mid-block, and
    every sequence is visited. Either way every table is plain stepping's."""
    seen = _spy_async_lazy(monkeypatch)
    cfg = SimConfig(block_size=4, num_gpu_blocks=150, max_num_batched_tokens=128, max_num_seqs=16,
                    sliding_window=window, async_scheduling=True)
    fast = _run("multi-turn", 3, 20.0, cfg, False)
    assert seen["lazy"] == lazy
    _same(fast, _run("multi-turn", 3, 20.0, cfg.replace(shortcuts=False), False))


def _async_taken(monkeypatch: pytest.MonkeyPatch) -> list:
    from kvsim.sim.engine.async_quiet import AsyncQuietRuns

    return built(monkeypatch, AsyncQuietRuns)


@pytest.mark.parametrize(("extra", "taken"), [({}, (167, 182)), ({"record_ops": True}, (167, 182)),
                                              ({"kv_events": True}, (167, 182)),
                                              ({"closed_loop_sessions": True}, (167, 182))])
def test_async_quiet_runs_take_the_steps_of_lazy_decodes_alone(monkeypatch: pytest.MonkeyPatch, extra: dict,
                                                               taken: tuple[int, int]) -> None:
    """Under async output a lightly loaded engine's steps run in a loop of their own
    (`sim.engine.async_quiet`): here 349 of its 350, 167 of lazy decodes alone (the 184 the
    scheduler takes without its RUNNING pass, less the 17 with a request WAITING) and 182 whose pass
    visits plain decodes (`AsyncQuietRuns._decodes`, WAITING offered the rest as the general step
    offers it); the first is the general step's. With KV events each step's batch of them is handed
    on where the general step hands it on. Tables, op streams and KV events are plain stepping's."""
    from tests.sim.engine.test_record_ops import same_stream

    made = _async_taken(monkeypatch)
    cfg = SimConfig(block_size=16, num_gpu_blocks=400, async_scheduling=True, **extra)
    fast = _run("unique", 3, 2.0, cfg, False)
    assert [(q.taken - q.decoded, q.decoded) for q in made] == [taken]
    assert len(fast.steps) == 350
    slow = _run("unique", 3, 2.0, cfg.replace(shortcuts=False), False)
    assert len(made) == 1  # the switch turns them off
    _same(fast, slow)
    if extra.get("record_ops"):
        same_stream(fast.manager.ops.records(), slow.manager.ops.records())
    if extra.get("kv_events"):
        assert fast.kv_events == slow.kv_events and len(fast.kv_events) == 94


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    kind=st.sampled_from(sorted(SHAPES)),
    seed=st.integers(0, 10_000),
    rate=st.sampled_from([2.0, 20.0, 200.0]),
    block_size=st.sampled_from([1, 4, 16]),
    num_gpu_blocks=st.integers(12, 160),
    budget=st.sampled_from([32, 64, 512]),
    max_seqs=st.sampled_from([4, 16, 32]),
    eviction=st.sampled_from(["lru", "arc", "s3fifo", "fifo", "lfu", "cost", "pinned"]),
    caching=st.booleans(),
    chunked=st.booleans(),
    watermark=st.sampled_from([0.0, 0.05]),
    closed=st.booleans(),
    active=st.sampled_from([None, 1, 3]),
    long_prefill=st.sampled_from([0, 0, 8]),
    adaptive=st.booleans(),
    reserve=st.sampled_from([True, True, False]),
    max_len=st.sampled_from([None, None, 48, 100]),
    records=st.booleans(),
    events=st.booleans(),
)
def test_async_quiet_runs_change_nothing(kind: str, seed: int, rate: float,
                                         block_size: int, num_gpu_blocks: int, budget: int, max_seqs: int,
                                         eviction: str, caching: bool, chunked: bool, watermark: float, closed: bool,
                                         active: int | None, long_prefill: int, adaptive: bool, reserve: bool,
                                         max_len: int | None, records: bool, events: bool) -> None:
    """The async output's runs (`sim.engine.async_quiet`: steps of lazy decodes alone, and steps
    whose RUNNING pass visits plain decodes, `AsyncQuietRuns._decodes`, admissions after them
    included) leave steps, requests, summary and op counts (and op streams) as plain stepping's,
    over random workloads (fanned-out samples, closed-loop sessions) and configurations (vLLM
    0.31+'s admission knobs, sequences stopped at max_model_len, every eviction policy), KV events
    (each step's batch, in order) included."""
    from tests.sim.engine.test_record_ops import same_stream

    cfg = SimConfig(model="llama-3-8b", gpu="h100-sxm", block_size=block_size, num_gpu_blocks=num_gpu_blocks,
                    max_num_batched_tokens=max(budget, max_seqs), max_num_seqs=max_seqs, eviction=eviction,
                    enable_prefix_caching=caching, enable_chunked_prefill=chunked, watermark=watermark,
                    closed_loop_sessions=closed, max_num_active_seqs=None if active is None else min(active, max_seqs),
                    long_prefill_token_threshold=long_prefill, long_prefill_token_threshold_adaptive=adaptive,
                    scheduler_reserve_full_isl=reserve, max_model_len=max_len, record_ops=records,
                    kv_events=events, async_scheduling=True)
    try:
        fast = _run(kind, seed, rate, cfg, False)
    except ValueError:  # a configuration this workload cannot run on: both refuse it alike
        with pytest.raises(ValueError):
            _run(kind, seed, rate, cfg.replace(shortcuts=False), False)
        return
    slow = _run(kind, seed, rate, cfg.replace(shortcuts=False), False)
    _same(fast, slow)
    if records:
        same_stream(fast.manager.ops.records(), slow.manager.ops.records())
    assert fast.kv_events == slow.kv_events


def test_async_quiet_runs_take_a_loaded_engines_decodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a tight cache under async output, requests WAITING at 752 of the run's 790 steps, the steps
    of plain decodes run in the loop too (711, beside 23 of lazy decodes alone), WAITING offered the
    rest of each budget as the general step offers it (a blocked head skipped, an admission made
    there); tables are plain stepping's."""
    made = _async_taken(monkeypatch)
    cfg = SimConfig(block_size=4, num_gpu_blocks=40, max_num_batched_tokens=64, max_num_seqs=8,
                    async_scheduling=True)
    fast = _run("shared-prefix", 5, 200.0, cfg, False)
    assert [(q.taken - q.decoded, q.decoded) for q in made] == [(23, 711)], len(fast.steps)
    assert ((fast.steps.waiting > 0).sum(), len(fast.steps)) == (752, 790)
    _same(fast, _run("shared-prefix", 5, 200.0, cfg.replace(shortcuts=False), False))


@pytest.mark.parametrize("extra", [{}, {"record_ops": True}, {"kv_events": True}])
def test_async_steps_that_only_decode_lazily_skip_the_passes(monkeypatch: pytest.MonkeyPatch, extra: dict) -> None:
    """At low load under async output most steps have every running sequence lazy and none due:
    the scheduler skips their RUNNING pass (`Shortcuts.lazy_step`: the pass's lazy totals alone),
    and the async runs take stretches of them without a batch each (`AsyncQuietRuns._stretch`, not
    with KV events or op records, whose steps each go through `lazy_step`). Tables, op streams and
    KV events are plain stepping's: here 184 of the run's 350 steps."""
    from kvsim.sim.engine import async_quiet, shortcuts
    from tests.sim.engine.test_record_ops import same_stream

    taken, stretched = [], []
    lazy_step, stretch = shortcuts.Shortcuts.lazy_step, async_quiet.AsyncQuietRuns._stretch

    def spy(self: shortcuts.Shortcuts, b, k: int, max_tokens: int) -> int:
        taken.append(k)
        return lazy_step(self, b, k, max_tokens)

    def stretch_spy(self, *args):
        out = stretch(self, *args)
        stretched.append(out[4])
        return out

    monkeypatch.setattr(shortcuts.Shortcuts, "lazy_step", spy)
    monkeypatch.setattr(async_quiet.AsyncQuietRuns, "_stretch", stretch_spy)
    cfg = SimConfig(block_size=16, num_gpu_blocks=400, async_scheduling=True, **extra)
    fast = _run("unique", 3, 2.0, cfg, False)
    assert (len(taken) + sum(stretched), len(fast.steps)) == (184, 350)
    assert sum(stretched) == (120 if not extra else 0)
    n = len(taken)
    slow = _run("unique", 3, 2.0, cfg.replace(shortcuts=False), False)
    assert len(taken) == n  # the switch turns it off
    _same(fast, slow)
    if extra.get("record_ops"):
        same_stream(fast.manager.ops.records(), slow.manager.ops.records())
    if extra.get("kv_events"):
        assert fast.kv_events == slow.kv_events and fast.kv_events
