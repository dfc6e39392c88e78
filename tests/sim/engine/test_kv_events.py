"""The engine takes vLLM's KV events once a step (kvcache.events): stamped batches, and a run with
them on is the same run as without."""

from __future__ import annotations

import pandas as pd

from kvsim.kvcache.events import BlockRemoved, BlockStored, EventBatch
from kvsim.kvcache.hashing import block_keys, unique_keys
from kvsim.sim.engine.run import simulate
from tests.sim.engine.engine_fixtures import FlatCost, req, run
from tests.sim.engine.test_engine import _mixed, _stress


def test_each_step_that_queued_events_is_one_stamped_batch() -> None:
    a = [req("a", 0.0, list(range(10)), 3), req("b", 0.5, [*range(8), 50, 51], 2)]
    res = run(a, kv_events=True, num_gpu_blocks=6)
    keys = block_keys(list(range(8)), 4)
    (tail,) = unique_keys(0, 2, 3)  # a block holding a's decoded tokens 10 and 11 (uid 0): kvsim's stand-ins
    # step 0 (ends at 1.0) caches a's prompt blocks; step 1 (b hits 8 tokens) caches nothing; step 2
    # computes a's token 11, filling its third block
    assert res.kv_events == [
        EventBatch(1.0, 0, 0, [BlockStored(keys[:2], None, list(range(8)), 4)]),
        EventBatch(3.0, 0, 2, [BlockStored([tail], keys[1], [8, 9, -11, -12], 4)]),
    ]


def test_events_change_nothing_and_name_every_eviction() -> None:
    """Events on give the same tables as off; every
    eviction is one BlockRemoved, handed to the sink given instead of kept on the result."""
    cfg = _stress(parallel_sampling="fork")
    off = simulate(_mixed(), cfg, cost_model=FlatCost(0.01))
    got: list[EventBatch] = []
    on = simulate(_mixed(), cfg.replace(kv_events=True), cost_model=FlatCost(0.01), kv_events=got.append)
    pd.testing.assert_frame_equal(off.steps, on.steps)
    pd.testing.assert_frame_equal(off.requests, on.requests)
    assert on.kv_events is None and off.kv_events is None
    removed = sum(isinstance(e, BlockRemoved) for b in got for e in b.events)
    assert removed == off.summary["evictions"] == 699
    steps = [b.step for b in got]
    assert steps == sorted(set(steps)) and all(b.replica == 0 and b.events for b in got)
