"""The cache-replay driver on hand-traced workloads."""

from dataclasses import asdict

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsim.kvcache.manager import KVCacheManager
from kvsim.kvcache.replay import replay
from kvsim.kvcache.sequence import Sequence
from kvsim.workloads.request import make_request


def req(i, prompt, out):
    return make_request(f"r{i}", float(i), np.asarray(prompt), out)


def test_sequential_hits_rejects_and_decodes():
    reqs = [req(0, range(10), 3), req(1, range(10), 1), req(2, range(100, 140), 5), req(3, range(9), 0)]
    recs = []
    res = replay(reqs, KVCacheManager(10, 4), on_record=recs.append)
    assert [(r.id, r.hit_tokens, r.output_tokens, r.status) for r in recs] == [
        ("r0", 0, 3, "finished"),
        ("r1", 8, 1, "finished"),
        ("r2", 0, 0, "rejected"),
        ("r3", 8, 1, "finished"),  # output_len 0 counts as 1
    ]
    assert (res.prompt_tokens, res.hit_tokens, res.rejected) == (69, 16, 1)


def test_sequential_truncates_when_a_decode_slot_cannot_be_had():
    recs = []
    replay([req(0, range(16), 10)], KVCacheManager(5, 4), on_record=recs.append)
    # 4 usable blocks hold 16 tokens: the first decode needs a 5th block
    assert [(r.output_tokens, r.status) for r in recs] == [(1, "truncated")]


def test_concurrent_preempts_the_youngest_and_readmits_it():
    reqs = [req(0, range(8), 6), req(1, range(50, 58), 6)]
    recs = []
    res = replay(reqs, KVCacheManager(6, 4), max_running=2, on_record=recs.append)
    assert [asdict(r) for r in recs] == [
        dict(id="r0", prompt_tokens=8, hit_tokens=0, output_tokens=6, status="finished", preemptions=0),
        dict(id="r1", prompt_tokens=8, hit_tokens=0, output_tokens=6, status="finished", preemptions=1),
    ]
    assert res.preemptions == 1


def test_concurrent_rejects_a_head_that_cannot_fit_an_empty_pool():
    reqs = [req(0, range(40), 2), req(1, range(8), 2)]
    recs = []
    replay(reqs, KVCacheManager(6, 4), max_running=4, on_record=recs.append)
    assert [(r.id, r.status) for r in recs] == [("r0", "rejected"), ("r1", "finished")]


def test_concurrent_shared_prefix_hits_once_cached():
    reqs = [req(i, list(range(8)) + [100 + i], 2) for i in range(3)]
    recs = []
    replay(reqs, KVCacheManager(64, 4), max_running=8, on_record=recs.append)
    # all three admitted in step 1: r0 fills blocks 0-1 before r1 is looked up
    assert [r.hit_tokens for r in recs] == [0, 8, 8]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 30), st.integers(0, 12)), min_size=1, max_size=12),
       st.integers(3, 16), st.sampled_from(["lru", "s3fifo"]))
def test_sequential_bulk_decode_equals_per_token(reqs, num_blocks, policy):
    workload = [req(i, list(range(100 * p, 100 * p + n)), out) for i, (p, n, out) in enumerate(reqs)]
    fast_recs, slow_recs = [], []
    fast = KVCacheManager(num_blocks, 4, eviction=policy)
    replay(workload, fast, on_record=fast_recs.append)
    slow = KVCacheManager(num_blocks, 4, eviction=policy)
    for uid, r in enumerate(workload):  # the per-token loop the driver's docstring describes
        s = Sequence(r.id, r.prompt, uid=uid)
        blocks, hit = slow.get_computed_blocks(s)
        if slow.allocate_slots(s, s.num_tokens - hit, hit, blocks) is None:
            slow_recs.append((r.id, 0, 0, "rejected"))
            continue
        s.num_computed_tokens = s.num_tokens
        s.append_tokens(1)
        sampled, status = 1, "finished"
        while sampled < max(r.output_len, 1):
            if slow.allocate_slots(s, 1) is None:
                status = "truncated"
                break
            s.num_computed_tokens += 1
            s.append_tokens(1)
            sampled += 1
        slow.free(s)
        slow_recs.append((r.id, hit, sampled, status))
    assert [(x.id, x.hit_tokens, x.output_tokens, x.status) for x in fast_recs] == slow_recs
    assert [b.block_id for b in fast.pool.blocks if b.block_hash is not None] == \
        [b.block_id for b in slow.pool.blocks if b.block_hash is not None]
    assert fast.pool.num_evictions == slow.pool.num_evictions
