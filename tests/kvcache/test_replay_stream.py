"""Concurrent cache replay streams its input: a request is taken only when one can be admitted."""

from dataclasses import astuple

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsim.kvcache.manager import KVCacheManager
from kvsim.kvcache.replay import replay
from kvsim.workloads.request import make_request

# (prefix group, prompt length, output length): groups 0 and 1 share prompt blocks
SHAPES = [(0, 10, 7), (0, 12, 5), (1, 9, 8), (0, 10, 3), (2, 30, 2), (1, 13, 6), (3, 6, 9), (0, 11, 4)]


def workload(shapes=SHAPES):
    return [
        make_request(f"r{i}", float(i), np.arange(100 * p, 100 * p + n), out)
        for i, (p, n, out) in enumerate(shapes)
    ]


def streamed(requests, manager, recs, pulls):
    """Yield `requests`, noting (replay step, records done) at each pull and checking
    that fewer than k taken requests are unfinished: the waiting line was empty."""
    for taken, r in enumerate(requests):
        pulls.append((manager.ops.step, len(recs)))
        assert taken - len(recs) < 3
        yield r


def test_concurrent_takes_a_request_only_when_it_can_admit_one():
    m, recs, pulls = KVCacheManager(7, 4), [], []
    replay(streamed(workload(), m, recs, pulls), m, max_running=3, on_record=recs.append)
    # r0-r2 fill the 3 slots in step 0; r3 waits for two to finish, r5-r7 for r4's rejection
    assert pulls == [(0, 0), (0, 0), (0, 0), (7, 2), (7, 2), (15, 5), (15, 5), (15, 5)]
    assert len(recs) == 8


def test_concurrent_streamed_equals_the_eager_replay_with_preemptions():
    # golden values from the replay that built every request up front (before streaming)
    m, recs = KVCacheManager(7, 4), []
    res = replay(iter(workload()), m, max_running=3, on_record=recs.append)
    assert [astuple(r) for r in recs] == [
        ("r1", 12, 8, 5, "finished", 0),
        ("r0", 10, 0, 7, "finished", 0),
        ("r3", 10, 8, 3, "finished", 0),
        ("r2", 9, 0, 8, "finished", 0),
        ("r4", 30, 0, 0, "rejected", 0),
        ("r5", 13, 8, 6, "finished", 0),
        ("r6", 6, 0, 9, "finished", 1),
        ("r7", 11, 0, 4, "finished", 1),
    ]
    assert res.as_dict() == dict(
        requests=8, prompt_tokens=101, hit_tokens=24, hit_rate=24 / 101, output_tokens=42,
        evicted_blocks=16, rejected=1, truncated=0, preemptions=2,
    )
    assert (m.ops.step, dict(m.ops.counts)) == (30, {"write": 52, "free": 31, "evict": 16})


def test_concurrent_streamed_equals_the_eager_replay_with_a_truncation():
    m, recs = KVCacheManager(5, 4), []
    res = replay(iter(workload()), m, max_running=3, on_record=recs.append)
    assert [astuple(r) for r in recs] == [
        ("r0", 10, 0, 7, "finished", 0),
        ("r1", 12, 8, 5, "finished", 1),
        ("r2", 9, 0, 8, "finished", 0),
        ("r3", 10, 0, 3, "finished", 0),
        ("r4", 30, 0, 0, "rejected", 0),
        ("r5", 13, 4, 4, "truncated", 0),
        ("r6", 6, 0, 9, "finished", 0),
        ("r7", 11, 0, 4, "finished", 0),
    ]
    assert (res.hit_tokens, res.output_tokens, res.evicted_blocks, res.preemptions) == (12, 40, 20, 1)
    assert (m.ops.step, dict(m.ops.counts)) == (40, {"write": 52, "free": 28, "evict": 20})


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 30), st.integers(0, 12)), min_size=1, max_size=12),
       st.integers(3, 16))
def test_concurrent_never_takes_ahead_and_matches_a_list_input(shapes, num_blocks):
    m, recs, pulls = KVCacheManager(num_blocks, 4), [], []
    res = replay(streamed(workload(shapes), m, recs, pulls), m, max_running=3, on_record=recs.append)
    ref_recs = []
    ref = replay(workload(shapes), KVCacheManager(num_blocks, 4), max_running=3, on_record=ref_recs.append)
    assert len(pulls) == len(shapes)
    assert [astuple(r) for r in recs] == [astuple(r) for r in ref_recs]
    assert res.as_dict() == ref.as_dict()
