"""Defragmenter: exact moves, threshold, batch cap, mapping round trips, and invariants."""

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsim.kvcache.block_table import BlockTable
from kvsim.kvcache.defrag import PAD_BUCKETS, Defragmenter, exchange_permutation


def test_moves_highest_used_into_lowest_holes():
    d = Defragmenter(20, threshold=3)
    d.use_many([1, 2, 10, 12, 15])
    assert (d.max_used(), d.num_used(), d.fragmentation()) == (15, 5, 10)
    # the pair (2, 6) is not taken: the next hole is above the next used block
    assert d.defragment() == [(15, 3), (12, 4), (10, 5)]
    assert (d.max_used(), d.num_used(), d.fragmentation()) == (5, 5, 0)
    assert d.resolve(np.array([1, 2, 10, 12, 15])).tolist() == [1, 2, 5, 4, 3]
    assert [d.unresolve(p) for p in (3, 4, 5, 15)] == [15, 12, 10, 3]
    assert d.ref_counts[[3, 4, 5, 10, 12, 15]].tolist() == [1, 1, 1, 0, 0, 0]
    assert (d.num_moves, d.num_defrags) == (3, 1)
    assert d.defragment() == []


def test_stops_when_free_passes_used_and_exchanges_ref_counts():
    d = Defragmenter(40, threshold=2)
    d.use_many([2, 3, 30, 30])
    assert d.defragment() == [(30, 1)]
    assert d.ref_counts[[1, 2, 3, 30]].tolist() == [2, 1, 1, 0]
    assert d.ref_count(30) == 2
    assert (d.max_used(), d.fragmentation()) == (3, 0)


def test_threshold_boundary():
    d = Defragmenter(20, threshold=3)
    d.use_many([1, 2, 6])
    assert d.fragmentation() == 3
    assert d.defragment() == []  # exactly at the threshold: no moves
    d.release(1)
    assert d.fragmentation() == 4
    assert d.defragment() == [(6, 1)]


def test_batch_capped_at_largest_bucket():
    d = Defragmenter(20, threshold=0, pad_buckets=(2, 4))
    d.use_many(range(11, 19))
    assert d.defragment() == [(18, 1), (17, 2), (16, 3), (15, 4)]
    assert (d.max_used(), d.fragmentation()) == (14, 6)
    assert d.defragment() == [(14, 5), (13, 6), (12, 7), (11, 8)]
    assert (d.max_used(), d.fragmentation(), d.num_moves) == (8, 0, 8)


def test_default_cap_is_512():
    d = Defragmenter(2000)
    d.use_many(range(1000, 1600))
    moves = d.defragment()
    assert len(moves) == 512
    assert moves[0] == (1599, 1) and moves[-1] == (1088, 512)
    assert (d.max_used(), d.fragmentation()) == (1087, 487)


def test_mapping_round_trips_over_two_defragmentations():
    d = Defragmenter(20, threshold=1)
    d.use_many([5, 9, 12])
    assert d.defragment() == [(12, 1), (9, 2), (5, 3)]
    d.use_many([4, 17])
    d.release(9)  # frees physical 2
    assert d.ref_counts[2] == 0
    assert d.defragment() == [(17, 2)]
    # allocator 17 now lives at 2; the idle allocator id 9 that owned 2 takes 17
    assert d.resolve(np.array([12, 5, 4, 17, 9])).tolist() == [1, 3, 4, 2, 17]
    assert (d.unresolve(2), d.unresolve(17)) == (17, 9)
    assert d.unresolve(d.resolve(np.arange(20))).tolist() == list(range(20))
    d.release(12)
    assert d.ref_counts[1] == 0 and d.num_used() == 3
    d.release(17)
    assert d.ref_counts[2] == 0 and d.num_used() == 2
    assert d.max_used() == 4


def test_use_release_many_with_repeats_and_lazy_max():
    d = Defragmenter(16)
    d.use_many([3, 3, 10])
    assert (d.ref_count(3), d.num_used(), d.max_used()) == (2, 2, 10)
    d.release_many([10, 3])
    assert (d.ref_count(3), d.num_used(), d.max_used()) == (1, 1, 3)
    with pytest.raises(ValueError, match=r"release of block 3 \(physical 3\) with ref count 1"):
        d.release_many([3, 3])
    assert d.ref_count(3) == 1  # a failed release changes nothing
    d.release(3)
    assert (d.num_used(), d.max_used(), d.fragmentation()) == (0, 0, 0)
    assert d.defragment() == []


def test_padded_size():
    d = Defragmenter(8)
    assert [d.padded_size(n) for n in (0, 1, 8, 9, 300, 512, 513, 10_000)] == [
        8, 8, 8, 16, 512, 512, 512, 512
    ]


def test_errors():
    d = Defragmenter(20)
    with pytest.raises(ValueError, match="block id 0 not in"):
        d.use(0)
    with pytest.raises(ValueError, match="block id 20 not in"):
        d.use_many([1, 20])
    with pytest.raises(ValueError, match=r"release of block 4 \(physical 4\) with ref count 0"):
        d.release(4)
    with pytest.raises(ValueError, match="allocator id -1"):
        d.resolve(-1)
    with pytest.raises(ValueError, match="physical id 25"):
        d.unresolve(np.array([1, 25]))
    with pytest.raises(ValueError, match="strictly ascending"):
        Defragmenter(20, pad_buckets=(16, 8))
    assert d.num_used() == 0


def test_exchange_permutation_keeps_physical_block_tables_in_step():
    d = Defragmenter(20, threshold=3)
    rows = [[1, 12], [15, 2, 10]]
    for r in rows:
        d.use_many(r)
    bt = BlockTable(4, 2, 3, 8)
    for i, r in enumerate(rows):
        bt.add_row(d.resolve(np.array(r)), i)
    moves = d.defragment()
    perm = exchange_permutation(moves, 20)
    assert perm[[3, 4, 5, 10, 12, 15]].tolist() == [15, 12, 10, 5, 4, 3]
    bt.remap(perm)
    assert bt.table.tolist() == [[1, 4, 0], [3, 2, 5]]
    for i, r in enumerate(rows):
        assert bt.row(i).tolist() == d.resolve(np.array(r)).tolist()


_BUCKETS = st.sampled_from([(2, 4), (8,), PAD_BUCKETS])
_OPS = st.lists(st.tuples(st.sampled_from(["use", "use", "release", "defrag"]), st.integers(0, 1 << 20)), max_size=80)


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(2, 48), threshold=st.integers(0, 6), buckets=_BUCKETS, ops=_OPS)
def test_random_sequences_keep_invariants(num_blocks, threshold, buckets, ops):
    d = Defragmenter(num_blocks, threshold=threshold, pad_buckets=buckets)
    held: list[int] = []  # allocator ids, one entry per reference
    for kind, x in ops:
        if kind == "use":
            held.append(1 + x % (num_blocks - 1))
            d.use(held[-1])
        elif kind == "release" and held:
            d.release(held.pop(x % len(held)))
        elif kind == "defrag":
            alloc_refs = d.ref_counts[d.fwd_mapping].copy()
            fwd_before = d.fwd_mapping.copy()
            moves = d.defragment()
            assert d.ref_counts[d.fwd_mapping].tolist() == alloc_refs.tolist()
            assert exchange_permutation(moves, num_blocks)[fwd_before].tolist() == d.fwd_mapping.tolist()
            assert d.fragmentation() <= threshold or len(moves) == buckets[-1]
        assert sorted(d.fwd_mapping.tolist()) == list(range(num_blocks))
        assert d.bwd_mapping[d.fwd_mapping].tolist() == list(range(num_blocks))
        assert d.fwd_mapping[0] == 0
        counts = Counter(held)
        assert [d.ref_count(a) for a in range(num_blocks)] == [counts[a] for a in range(num_blocks)]
        used = np.flatnonzero(d.ref_counts)
        assert d.num_used() == used.size
        if x % 3 == 0:  # query only sometimes, so a stale max also reaches defragment()
            assert d.max_used() == (int(used[-1]) if used.size else 0)


def test_max_used_after_releasing_a_far_top():
    d = Defragmenter(5000, threshold=10_000)
    d.use_many([10, 1500, 4000])
    d.release(4000)
    assert d.max_used() == 1500
    d.release(1500)
    assert (d.max_used(), d.fragmentation()) == (10, 9)
