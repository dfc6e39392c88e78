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


def test_decoded_tokens_are_numbered_by_arrival_not_admission() -> None:
    """Priority scheduling runs b (priority 0) before a (priority 1), which arrived first; each
    request's decoded stand-ins still carry its arrival index (a 0, b 1), as `kvcache.replay` and
    the conform drivers number them (`token_ids(request, index)`), so the tokens a block stores
    do not depend on the admission order. Block [4, 8) of each holds prompt tokens 4, 5 and
    decoded tokens 6, 7: -(1 + (uid << 24 | position))."""
    a, b = req("a", 0.0, list(range(6)), 4, priority=1), req("b", 0.0, list(range(10, 16)), 4, priority=0)
    res = run([a, b], kv_events=True, scheduling="priority", max_num_seqs=1, num_gpu_blocks=12)
    stored = [(batch.step, e.token_ids) for batch in res.kv_events for e in batch.events
              if isinstance(e, BlockStored) and len(e.token_ids) == 4 and e.token_ids[0] in (4, 14)]
    first_b, first_a = stored
    assert first_b[1] == [14, 15, -(1 + (1 << 24 | 6)), -(1 + (1 << 24 | 7))]
    assert first_a[1] == [4, 5, -7, -8]
    assert first_b[0] < first_a[0]  # b ran first
