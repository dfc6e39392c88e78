"""KV events with the speed shortcuts on (lazy decodes, the blocked head, quiet runs): the same
batches, event for event and step for step, as plain stepping, which makes every block call as
vLLM does.

What the shortcuts must keep for the event stream (vllm/v1/core/block_pool.py, vLLM 0.33):
`cache_full_blocks` queues one `BlockStored` per call that caches new blocks, and
`_maybe_evict_cached_block` one `BlockRemoved` per cached block reused, in the order the
scheduler makes those calls; `Scheduler.update_from_output` takes the queue once a step. So a
block is cached in the step its last slot is written (no lazy fill, cached when freed), a quiet
step's new blocks are taken a sequence at a time (their removals between the cachings), and each
quiet step hands on its batch as a general step does. A router fed by the events (`dynamo`,
`llm-d-precise`) then runs its replicas with the shortcuts too."""

from __future__ import annotations

import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsim.kvcache.events import BlockRemoved, BlockStored
from kvsim.sim.api import default_workload
from kvsim.sim.cluster.run import simulate_cluster
from kvsim.sim.engine.config import SimConfig
from kvsim.sim.engine.cost_model import CostModel
from kvsim.sim.engine.run import RunResult, simulate
from kvsim.workloads.build import build_workload
from tests.sim.engine.engine_fixtures import GROUPS, WINDOW_MODELS, FlatCost
from tests.sim.engine.test_quiet_runs import HYBRID_SHAPES, SHAPES, _same, _taken


def _same_events(fast: RunResult, slow: RunResult) -> None:
    _same(fast, slow)
    assert fast.kv_events == slow.kv_events  # batch by batch: time, step and every event's fields


ONE_GROUP = {  # one group's workload and cache, drawn by both output modes' tests below
    "kind": st.sampled_from(sorted(SHAPES)),
    "seed": st.integers(0, 10_000),
    "rate": st.sampled_from([2.0, 20.0, 200.0]),
    "block_size": st.sampled_from([1, 2, 4, 16]),
    "slots": st.integers(200, 2_000),
    "budget": st.sampled_from([32, 64, 512]),
    "max_seqs": st.sampled_from([4, 16, 32]),
}


def _events_alike(kind: str, seed: int, rate: float, cfg: SimConfig, real_cost: bool) -> None:
    """The run's events (and tables) with the shortcuts on are plain stepping's."""
    wl = build_workload(kind, 30, rate, "poisson", 1.0, seed, dict(SHAPES[kind]))
    cost = CostModel.from_config(cfg) if real_cost else FlatCost(0.05)
    fast = simulate(wl, cfg, cost_model=cost)
    assert fast.kv_events, "a run with no events would prove nothing"
    _same_events(fast, simulate(wl, cfg.replace(shortcuts=False), cost_model=cost))


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    **ONE_GROUP,
    eviction=st.sampled_from(["lru", "lru", "arc", "fifo", "lfu"]),
    chunked=st.booleans(),
    watermark=st.sampled_from([0.0, 0.05]),
    real_cost=st.booleans(),
    closed=st.booleans(),
    long_prefill=st.sampled_from([0, 0, 8]),
    reserve=st.sampled_from([True, True, False]),
)
def test_events_with_the_shortcuts_are_plain_steppings(kind: str, seed: int, rate: float, block_size: int,
                                                       slots: int, budget: int, max_seqs: int,
                                                       eviction: str, chunked: bool, watermark: float,
                                                       real_cost: bool, closed: bool, long_prefill: int,
                                                       reserve: bool) -> None:
    cfg = SimConfig(model="llama-3-8b", gpu="h100-sxm", block_size=block_size, num_gpu_blocks=slots // block_size + 2,
                    max_num_batched_tokens=max(budget if chunked else 512, max_seqs), max_num_seqs=max_seqs,
                    eviction=eviction, enable_chunked_prefill=chunked, watermark=watermark, closed_loop_sessions=closed,
                    long_prefill_token_threshold=long_prefill, scheduler_reserve_full_isl=reserve, kv_events=True,
                    async_scheduling=False)
    _events_alike(kind, seed, rate, cfg, real_cost)


@settings(max_examples=20, deadline=None, derandomize=True)
@given(**ONE_GROUP, real_cost=st.booleans())
def test_async_events_with_the_shortcuts_are_plain_steppings(kind: str, seed: int, rate: float, block_size: int,
                                                             slots: int, budget: int, max_seqs: int,
                                                             real_cost: bool) -> None:
    """Under async output too: its lazy decodes (`AsyncLazy`) cache and take blocks only at visited
    steps, so every batch of events is plain stepping's."""
    cfg = SimConfig(model="llama-3-8b", gpu="h100-sxm", block_size=block_size, num_gpu_blocks=slots // block_size + 2,
                    max_num_batched_tokens=max(budget, max_seqs), max_num_seqs=max_seqs, kv_events=True,
                    async_scheduling=True)
    _events_alike(kind, seed, rate, cfg, real_cost)


@settings(max_examples=15, deadline=None, derandomize=True)
@given(
    kind=st.sampled_from(sorted(HYBRID_SHAPES)),
    seed=st.integers(0, 10_000),
    rate=st.sampled_from([5.0, 50.0]),
    model=st.sampled_from(WINDOW_MODELS),
    num_gpu_blocks=st.integers(40, 200),
    max_seqs=st.sampled_from([4, 16]),
    retention=st.sampled_from([0, None]),
)
def test_a_hybrid_models_events_with_the_shortcuts_are_plain_steppings(window_models, kind: str, seed: int,
                                                                       rate: float, model: tuple[int, str],
                                                                       num_gpu_blocks: int, max_seqs: int,
                                                                       retention: int | None) -> None:
    """vLLM's hybrid groups: each group's caching call is its own `BlockStored` (its `group_idx`), and
    a window's blocks let go between two takes come back first."""
    cfg = SimConfig(model=window_models[model], gpu="h100-sxm", num_gpu_blocks=num_gpu_blocks,
                    max_num_batched_tokens=256, max_num_seqs=max_seqs, prefix_cache_retention_interval=retention,
                    kv_events=True, async_scheduling=False)
    wl = build_workload(kind, 24, rate, "poisson", 1.0, seed, dict(HYBRID_SHAPES[kind]))
    fast = simulate(wl, cfg)
    assert fast.manager.num_groups == GROUPS[model[1]]
    _same_events(fast, simulate(wl, cfg.replace(shortcuts=False)))


def test_quiet_steps_hand_on_their_events(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loaded engine with events on takes most steps quiet, and those steps cache and evict: their
    batches are in the stream, the same as plain stepping's."""
    made = _taken(monkeypatch)
    cfg = SimConfig(model="llama-3-8b", gpu="h100-sxm", block_size=4, num_gpu_blocks=60, max_num_batched_tokens=64,
                    max_num_seqs=16, kv_events=True, async_scheduling=False)
    wl = build_workload("unique", 30, 200.0, "poisson", 1.0, 3, dict(SHAPES["unique"]))
    fast = simulate(wl, cfg, cost_model=FlatCost(0.05))
    assert len(made) == 1 and made[0].taken > len(fast.steps) // 2
    kinds = {type(e) for b in fast.kv_events for e in b.events}
    assert kinds == {BlockStored, BlockRemoved}
    _same_events(fast, simulate(wl, cfg.replace(shortcuts=False), cost_model=FlatCost(0.05)))


@pytest.mark.parametrize("router", ["dynamo", "llm-d-precise"])
def test_a_router_fed_by_events_routes_the_same_with_the_shortcuts(router: str) -> None:
    """The routers that read KV events see the same batches at the same times, so they route every
    request alike: every replica's tables and the event stream are those of plain stepping."""
    cfg = SimConfig(num_gpu_blocks=200, replicas=3, router=router, kv_events=True, async_scheduling=False)
    wl = default_workload()
    lines: dict[bool, list[str]] = {True: [], False: []}
    runs = {on: simulate_cluster(wl, cfg.replace(shortcuts=on), kv_events=lambda b, on=on: lines[on].append(b.json_line()))
            for on in (True, False)}
    assert runs[True].received.equals(runs[False].received)
    for fast, slow in zip(runs[True].replicas, runs[False].replicas, strict=True):
        pd.testing.assert_frame_equal(fast.steps, slow.steps)
        pd.testing.assert_frame_equal(fast.requests, slow.requests)
    assert len(lines[True]) > 1000 and lines[True] == lines[False]


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    kind=st.sampled_from(["shared-prefix", "multi-turn", "agent"]),
    seed=st.integers(0, 10_000),
    rate=st.sampled_from([5.0, 50.0]),
    router=st.sampled_from(["dynamo", "llm-d-precise"]),
    replicas=st.integers(2, 3),
    num_gpu_blocks=st.integers(40, 200),
    delay=st.sampled_from([0.0, 0.001, 0.05]),
)
def test_event_fed_routers_over_random_workloads_route_the_same_with_the_shortcuts(
        kind: str, seed: int, rate: float, router: str, replicas: int, num_gpu_blocks: int, delay: float) -> None:
    """The same, over random workloads (closed-loop turns too), cache sizes and event delays: where
    each request went and every replica's tables, with the shortcuts on and off."""
    cfg = SimConfig(model="llama-3-8b", gpu="h100-sxm", block_size=4, num_gpu_blocks=num_gpu_blocks,
                    max_num_batched_tokens=256, max_num_seqs=16, replicas=replicas, router=router,
                    kv_event_delay=delay, seed=seed, async_scheduling=False)
    wl = build_workload(kind, 30, rate, "poisson", 1.0, seed, dict(SHAPES[kind]))
    fast, slow = (simulate_cluster(wl, cfg.replace(shortcuts=on)) for on in (True, False))
    assert fast.received.equals(slow.received)
    for a, b in zip(fast.replicas, slow.replicas, strict=True):
        pd.testing.assert_frame_equal(a.steps, b.steps)
        pd.testing.assert_frame_equal(a.requests, b.requests)
