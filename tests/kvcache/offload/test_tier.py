"""The host tier on hand-worked sequences, each pinning one rule of vLLM 0.33's offloading
manager or policies (the file and function named in each test; paths under vllm/v1/kv_offload/).

Keys are small ints; positions are chunk end tokens, 16 tokens a chunk. The expected
values were also checked against vLLM's own `CPUOffloadingManager`.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsim.kvcache.events import BlockRemoved, BlockStored
from kvsim.kvcache.offload import OFFLOAD_POLICIES, HostARC, HostLRU, make_policy
from kvsim.kvcache.offload.size import num_host_chunks
from kvsim.kvcache.offload.tier import HIT, MISS, PENDING, HostTier, StoreOutput


def pos(keys: list[int], first: int = 0) -> list[int]:
    """End tokens of chunks `first`, `first + 1`, ... of a request."""
    return [16 * (first + i + 1) for i in range(len(keys))]


def store(tier: HostTier, req: str, keys: list[int], first: int = 0, *,
          complete: bool = True) -> StoreOutput | None:
    out = tier.prepare_store(req, keys, pos(keys, first))
    if complete and out is not None:
        tier.complete_store(out.keys)
    return out


def lists(tier: HostTier) -> tuple[list[int], list[int], list[int], list[int], float]:
    arc = tier.policy
    assert isinstance(arc, HostARC)
    return list(arc.t1), list(arc.t2), list(arc.b1), list(arc.b2), arc.target_t1


def test_slots_fresh_in_order_then_freed_last_first():
    """cpu/manager.py CPUOffloadingManager._allocate_chunks and _free_chunk."""
    t = HostTier(4)
    assert store(t, "A", [1, 2, 3], complete=False) == StoreOutput([1, 2, 3], [0, 1, 2], [])
    t.complete_store([1, 2], success=False)  # slots 0 then 1 freed
    t.complete_store([3])
    assert (t.lookup(1), t.lookup(3), t.num_free) == (MISS, HIT, 3)
    assert store(t, "B", [4, 5, 6]) == StoreOutput([4, 5, 6], [3, 1, 0], [])
    assert t.resident() == {3: 2, 4: 3, 5: 1, 6: 0}


def test_lookup_is_pending_until_the_store_completes():
    """cpu/manager.py CPUOffloadingManager.lookup and complete_store."""
    t = HostTier(2)
    store(t, "A", [7], complete=False)
    assert [t.lookup(7), t.lookup(8)] == [PENDING, MISS]
    t.complete_store([7, 8])  # a key not pending is ignored
    assert (t.lookup(7), t.num_pending, t.num_evictable) == (HIT, 0, 1)
    t.complete_store([7], success=False)  # already ready: a late failure changes nothing
    assert t.lookup(7) == HIT


def test_present_keys_are_skipped_and_only_ready_ones_count_as_reuse():
    """cpu/manager.py CPUOffloadingManager.prepare_store (ready_existing_keys) and
    cpu/policies/arc.py ARCCachePolicy.on_request_finished."""
    t = HostTier(4, "arc")
    store(t, "A", [1, 2], complete=False)
    t.complete_store([1])  # 2 stays pending
    t.request_finished("A")
    assert store(t, "B", [1, 2, 3]) == StoreOutput([3], [2], [])
    t.complete_store([2])
    t.request_finished("B")
    # 1 was ready when offered: reused, to T2; 2 was pending: not recorded, stays put
    assert lists(t) == ([2, 3], [1], [], [], 0.0)


def test_reading_back_a_chunk_the_request_stored_is_no_reuse():
    """cpu/manager.py CPUOffloadingManager._record_request_cache_access (reused keys exclude
    the request's own insertions)."""
    t = HostTier(2, "arc")
    store(t, "A", [1])
    t.prepare_load("A", [1], [16])
    t.complete_load([1])
    assert store(t, "A", [1]) == StoreOutput([], [], [])
    t.request_finished("A")
    assert lists(t) == ([1], [], [], [], 0.0)


def test_store_threshold_admits_on_the_second_offer():
    """cpu/manager.py CPUOffloadingManager.prepare_store (store_threshold filter)."""
    t = HostTier(4, store_threshold=2)
    assert store(t, "S1", [1, 2]) == StoreOutput([], [], [])
    assert store(t, "S2", [1, 2]) == StoreOutput([1, 2], [0, 1], [])
    assert store(t, "S3", [1, 2]) == StoreOutput([], [], [])
    assert (t.num_skipped, t.num_stores) == (2, 2)


def test_offer_counter_is_bounded_and_spares_the_current_offer():
    """cpu/manager.py CPUOffloadingManager._record_accesses (max_tracker_size)."""
    t = HostTier(8, store_threshold=2, max_tracker_size=2)
    store(t, "A", [1, 2, 3])  # the table fills with 1, 2; 3 finds no entry it may drop
    assert store(t, "B", [1, 2, 3]) == StoreOutput([1, 2], [0, 1], [])
    store(t, "C", [4])  # drops the oldest entry, 1
    store(t, "D", [5, 2])  # 2 is in this offer: 4 goes, not 2
    assert store(t, "E", [4]).keys == []  # 4 was forgotten: count 1 again
    assert t.num_skipped == 3 + 1 + 1 + 1 + 1


def test_eviction_is_all_or_nothing_and_pinned_chunks_stay():
    """cpu/manager.py CPUOffloadingManager.prepare_store and cpu/policies/lru.py
    LRUCachePolicy.evict; the sequence of /tmp/offload/drive_manager.py part 1."""
    t = HostTier(4)
    store(t, "A", [10, 11, 12, 13])
    t.request_finished("A")  # tail first: 13 oldest, 10 newest
    assert store(t, "B", [20, 21]) == StoreOutput([20, 21], [2, 3], [13, 12])
    assert t.prepare_load("C", [10], [16]) == [0]
    assert store(t, "C", [30, 31, 32, 33]) is None  # 4 needed, 3 evictable
    assert (t.num_alloc_failures, t.resident()) == (1, {10: 0, 11: 1, 20: 2, 21: 3})
    assert store(t, "C", [30, 31, 32], complete=False) == StoreOutput([30, 31, 32], [2, 3, 1], [11, 21, 20])
    t.complete_store([30, 31, 32], success=False)
    assert (t.lookup(30), t.num_free, t.num_evictions) == (MISS, 3, 5)


def test_the_offered_keys_are_protected():
    """cpu/manager.py CPUOffloadingManager.prepare_store (protected = set(keys))."""
    t = HostTier(2)
    store(t, "A", [1, 2])
    t.request_finished("A")  # 2 is the LRU victim
    assert store(t, "B", [2, 3], first=1) == StoreOutput([3], [0], [1])
    one = HostTier(1)
    store(one, "A", [1])
    assert store(one, "B", [1, 2]) is None  # the only evictable chunk is offered
    assert one.resident() == {1: 0}


def test_a_chunk_pinned_twice_is_evictable_after_both_loads():
    """cpu/manager.py CPUOffloadingManager.prepare_load and complete_load (ref counts)."""
    t = HostTier(2)
    store(t, "A", [1, 2])
    t.request_finished("A")
    t.prepare_load("B", [2], [32])
    t.prepare_load("C", [2], [32])
    assert store(t, "D", [3, 4]) is None
    t.complete_load([2])
    assert store(t, "D", [3, 4]) is None
    t.complete_load([2])
    # B's load raised 2 to B's provisional rank (lru.py on_request_access): 1 goes first
    assert store(t, "D", [3, 4]) == StoreOutput([3, 4], [1, 0], [1, 2])  # freed slots, LIFO
    with pytest.raises(ValueError, match="chunk 2 has no load in flight"):
        t.complete_load([2])
    with pytest.raises(ValueError, match="chunk 9 is not ready"):
        t.prepare_load("E", [4, 9], [32, 48])
    assert t.num_evictable == 2  # nothing pinned by the refused load


def test_lru_running_requests_rank_tail_first_and_finished_ones_newest():
    """cpu/policies/lru.py LRUCachePolicy.insert (request_rank, -position) and
    on_request_finished (fresh ranks, tail first)."""
    t = HostTier(4)
    store(t, "A", [1, 2])  # A's rank 1
    store(t, "B", [3, 4])  # B's rank 2
    assert store(t, "C", [5]).evicted == [2]  # A's tail, A ranks below B
    t.request_finished("A")  # 1 gets a fresh rank, above every running request
    assert store(t, "D", [6, 7]) == StoreOutput([6, 7], [2, 3], [4, 3])


def test_lru_a_running_request_never_lowers_a_rank():
    """cpu/policies/lru.py LRUCachePolicy.on_request_access (only raises to (request_rank, -position))."""
    t = HostTier(3)
    store(t, "B", [5], first=1)  # B's rank 1, 5 at (1, -32)
    store(t, "A", [1, 2])
    t.request_finished("A")  # 2 at (3, 0), 1 at (4, 0)
    t.prepare_load("B", [1], [16])  # (1, -16) is older than (4, 0): 1 keeps its rank
    t.complete_load([1])
    assert store(t, "C", [6, 7]).evicted == [5, 2]


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.tuples(st.integers(0, 10**12), st.integers(0, 2**39)), st.tuples(st.integers(0, 10**12), st.integers(0, 2**39)))
def test_lru_ranks_as_ints_keep_the_pairs_order(a: tuple[int, int], b: tuple[int, int]) -> None:
    """HostLRU keeps vLLM's rank pair (counter, -position) as one int (the heap compares ints): the
    order, and equality, of any two pairs is kept."""
    from kvsim.kvcache.offload.lru import _rank

    (ca, pa), (cb, pb) = a, b
    assert ((ca, -pa) < (cb, -pb)) == (_rank(ca, pa) < _rank(cb, pb))
    assert ((ca, -pa) == (cb, -pb)) == (_rank(ca, pa) == _rank(cb, pb))


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=24, unique=True), st.data())
def test_lru_victims_are_the_lowest_ranks_however_chunks_became_evictable(keys: list[int], data: st.DataObject) -> None:
    """cpu/policies/lru.py LRUCachePolicy.evict: the victims are the evictable, unprotected chunks
    of lowest (rank, key), in that order, whether the chunks became evictable in one call or one
    call each (so the lazy heap compacted at other times), pinned and unpinned since (a duplicate
    entry), with 64-bit keys (a heap entry packs rank and key into one int)."""
    reqs = data.draw(st.lists(st.sampled_from("ABC"), min_size=len(keys), max_size=len(keys)))
    positions = data.draw(st.lists(st.integers(1, 2**20), min_size=len(keys), max_size=len(keys)))
    together, one_by_one = HostLRU(len(keys)), HostLRU(len(keys))
    for lru in (together, one_by_one):
        for key, req, position in zip(keys, reqs, positions, strict=True):
            lru.insert([key], req, [position])
    evictable = data.draw(st.lists(st.sampled_from(keys), unique=True))
    together.mark_evictable(evictable)
    for key in evictable:
        one_by_one.mark_evictable([key])
    for key in data.draw(st.lists(st.sampled_from(evictable), unique=True)) if evictable else ():
        for lru in (together, one_by_one):  # pinned by a load and unpinned: a second entry at the same rank
            lru.mark_non_evictable(key)
            lru.mark_evictable([key])
    raised = data.draw(st.lists(st.sampled_from(keys), unique=True))  # a running request sees them
    for lru in (together, one_by_one):
        lru.on_request_access("D", raised, [16] * len(raised))
    live = set(evictable)
    for _ in range(3):  # evictions in a row (a failed one changes nothing), some chunks finished between
        protected = set(data.draw(st.lists(st.sampled_from(keys), unique=True)))
        n = data.draw(st.integers(0, len(keys)))
        ranked = sorted((together._ranks[k], k) for k in live if k not in protected)
        expected = [k for _, k in ranked[:n]] if n <= len(ranked) else None
        assert together.evict(n, protected) == expected
        assert one_by_one.evict(n, protected) == expected
        live -= set(expected or ())
        done = data.draw(st.lists(st.sampled_from(keys), unique=True))  # a request finished: fresh ranks
        for lru in (together, one_by_one):
            lru.on_request_finished("A", done, set(), set())


def test_lru_a_chunk_protected_from_one_eviction_is_the_next_ones_victim():
    """cpu/policies/lru.py LRUCachePolicy.evict: a protected chunk is passed over and stays
    evictable at its rank (vLLM pushes it back on the heap)."""
    lru = HostLRU(4)
    lru.insert([1, 2, 3], "A", [16, 32, 48])  # ranks: 3 lowest (tail first), then 2, then 1
    lru.mark_evictable([1, 2, 3])
    assert lru.evict(1, {3}) == [2]
    assert lru.evict(2, set()) == [3, 1]


def test_lru_keys_must_be_64_bit_hashes():
    """A heap entry holds its key in 64 bits: any other key is refused before it is ranked."""
    lru = HostLRU(4)
    for key in (-1, 2**64):
        with pytest.raises(ValueError, match="64-bit block hashes"):
            lru.insert([1, key], "A", [16, 32])
    assert lru._ranks == {}


def test_arc_reuse_promotes_at_finish_and_a_b1_ghost_raises_the_target():
    """cpu/policies/arc.py ARCCachePolicy.on_request_finished, on_store_miss and evict;
    the sequence of /tmp/offload/drive_manager.py part 2."""
    t = HostTier(4, "arc")
    store(t, "R1", [1, 2])
    t.request_finished("R1")
    assert lists(t) == ([2, 1], [], [], [], 0.0)
    t.prepare_load("R2", [1], [16])
    assert lists(t) == ([2, 1], [], [], [], 0.0)  # a load is no hit until the request finishes
    t.complete_load([1])
    t.request_finished("R2")
    assert lists(t) == ([2], [1], [], [], 0.0)
    assert store(t, "R3", [5, 6, 7]) == StoreOutput([5, 6, 7], [2, 3, 1], [2])
    t.request_finished("R3")
    assert lists(t) == ([7, 6, 5], [1], [2], [], 0.0)
    assert store(t, "R4", [2], first=1) == StoreOutput([2], [1], [7])
    assert lists(t) == ([6, 5, 2], [1], [7], [], 1.0)


def test_arc_fractional_target_and_the_int_rule():
    """cpu/policies/arc.py ARCCachePolicy.on_store_miss (max(1, |B2|/|B1|)) and evict
    (T1 while |T1| >= int(target))."""
    t = HostTier(4, "arc")
    store(t, "A", [1, 2, 3, 4])
    t.request_finished("A")
    t.prepare_load("B", [1, 2, 3], [16, 32, 48])
    t.complete_load([1, 2, 3])
    t.request_finished("B")
    assert lists(t) == ([4], [3, 2, 1], [], [], 0.0)
    store(t, "C", [5], complete=False)
    assert store(t, "C", [6, 7], first=1).evicted == [3, 2]  # T1 holds only 5, pending
    t.complete_store([5])
    t.request_finished("C")
    assert store(t, "D", [8], complete=False).evicted == [7]
    t.prepare_load("E", [6, 5], [32, 16])
    assert store(t, "E", [9], first=3, complete=False).evicted == [1]  # T1 pinned or pending: T2
    t.complete_store([8, 9])
    t.complete_load([6, 5])
    t.request_finished("D")
    t.request_finished("E")
    assert lists(t) == ([8, 9], [6, 5], [4, 7], [3, 2, 1], 0.0)
    assert store(t, "F", [4], first=3).evicted == [8]
    t.request_finished("F")
    assert lists(t) == ([9, 4], [6, 5], [7, 8], [3, 2, 1], 1.5)
    t.prepare_load("G", [9], [64])
    t.complete_load([9])
    t.request_finished("G")
    assert store(t, "H", [10]) == StoreOutput([10], [2], [4])  # |T1| = 1 >= int(1.5)
    assert lists(t) == ([10], [6, 5, 9], [7, 8, 4], [3, 2, 1], 1.5)


def test_arc_adapts_before_a_failed_store_once_per_request_tail_first():
    """cpu/manager.py CPUOffloadingManager.prepare_store (on_store_miss before the eviction
    check, deduplicated per request) and cpu/policies/arc.py ARCCachePolicy.on_store_miss."""
    t = HostTier(4, "arc")
    store(t, "A", [1, 2, 3, 4])
    t.request_finished("A")
    store(t, "B", [5, 6], complete=False)  # evicts 4, 3: B1 = [4, 3]
    t.prepare_load("C", [1, 2], [16, 32])
    assert store(t, "C", [3, 4], first=2) is None
    assert lists(t) == ([2, 1, 5, 6], [], [4, 3], [], 2.0)  # 4 then 3 moved to B1's end
    assert store(t, "C", [3, 4], first=2) is None
    assert lists(t)[4] == 2.0
    assert store(t, "D", [3, 4], first=2) is None
    assert lists(t)[4] == 4.0  # capped at the capacity


def test_arc_finish_leaves_keys_the_request_neither_stored_nor_reused():
    """cpu/policies/arc.py ARCCachePolicy.on_request_finished: a key whose store failed for
    lack of room, stored meanwhile by another request, is no hit for the first."""
    t = HostTier(1, "arc")
    store(t, "A", [1], complete=False)
    assert store(t, "B", [2]) is None  # 1 is pending
    t.complete_store([1])
    t.request_finished("A")
    assert store(t, "C", [2]).evicted == [1]
    t.request_finished("B")
    assert lists(t) == ([2], [], [1], [], 0.0)


def test_a_failed_offer_still_records_the_reuse():
    """cpu/manager.py CPUOffloadingManager.prepare_store (accesses recorded before the early
    return None) and cpu/policies/arc.py ARCCachePolicy.on_request_finished."""
    t = HostTier(2, "arc")
    store(t, "A", [1])
    t.request_finished("A")
    store(t, "X", [2], complete=False)
    assert store(t, "B", [1, 3]) is None  # 1 is offered (protected), 2 pending
    t.request_finished("B")
    assert lists(t) == ([2], [1], [], [], 0.0)


def test_arc_trims_each_ghost_list_to_the_capacity():
    """cpu/policies/arc.py ARCCachePolicy.evict: B1 and B2 each keep `capacity` keys,
    so |T1| + |B1| reaches 2c (the paper bounds it by c)."""
    t = HostTier(2, "arc")
    store(t, "A", [1, 2])
    t.request_finished("A")
    store(t, "B", [3, 4])
    t.request_finished("B")
    assert store(t, "C", [5, 6]).evicted == [4, 3]
    assert lists(t) == ([5, 6], [], [4, 3], [], 0.0)


def test_failed_store_leaves_no_ghost():
    """cpu/policies/arc.py ARCCachePolicy.remove."""
    t = HostTier(2, "arc")
    store(t, "A", [1], complete=False)
    t.complete_store([1], success=False)
    assert lists(t) == ([], [], [], [], 0.0)


def test_reset_drops_every_chunk_but_keeps_counts():
    """cpu/manager.py CPUOffloadingManager.reset_cache (the offer table survives it)."""
    t = HostTier(2, store_threshold=2)
    store(t, "A", [1])
    store(t, "B", [1], complete=False)
    t.reset()
    assert (t.resident(), t.num_free, t.num_pending, t.num_stores) == ({}, 2, 0, 1)
    assert store(t, "C", [1]) == StoreOutput([1], [0], [])  # third offer, fresh slot 0
    t.request_finished("A")  # a request from before the reset: nothing to commit


def test_num_host_chunks():
    """cpu/spec.py CPUOffloadingSpec.__init__: floor(S * 2^30 / round_up(W * world * bpc, 4096))."""
    llama3_8b = 32 * 16 * 8 * (128 + 128) * 2  # layers * block * kv heads * (K + V dims) * bf16
    assert llama3_8b == 2 << 20
    assert num_host_chunks(8, llama3_8b, 1) == 4096
    assert num_host_chunks(8, llama3_8b // 2, 2) == 4096  # TP 2: the size covers both workers
    assert num_host_chunks(8, llama3_8b, 1, blocks_per_chunk=4) == 1024
    assert num_host_chunks(1, 128, 1) == 262144  # a 128 B block is padded to a 4 KiB page
    assert num_host_chunks(0.001, 5000, 1) == 131  # int(1073741.824) // 8192
    with pytest.raises(ValueError, match="world_size must be at least 1, got 0"):
        num_host_chunks(8, llama3_8b, 0)
    with pytest.raises(ValueError, match="positive GiB, got 0"):
        num_host_chunks(0, llama3_8b, 1)


def test_policy_names():
    assert OFFLOAD_POLICIES == ("lru", "arc")
    assert isinstance(make_policy("lru", 4), HostLRU)
    assert make_policy("arc", 4).capacity == 4
    with pytest.raises(ValueError, match="unknown offload eviction policy 'lfu'; choose from lru, arc"):
        make_policy("lfu", 4)


def test_kv_events_as_the_connector_publishes_the_cpu_tiers_by_default():
    """cpu/manager.py CPUOffloadingManager.prepare_store (one removed event of the chunks it evicts)
    and complete_store (one stored event of the chunks made ready; a failure's is metadata_only and
    never published), as vllm/distributed/kv_transfer/kv_connector/v1/offloading/events.py
    OffloadingEventsTracker translates them without self-describing payloads: `_placeholder_stored`,
    a BlockStored a chunk with its key's hash alone (no parent, no tokens, block size 0), and
    `_take_removed_event`, one BlockRemoved of all the keys; medium "CPU"."""
    t = HostTier(2, kv_events=True)
    store(t, "A", [1, 2], complete=False)
    assert t.take_events() == []  # nothing published while the stores are in flight
    t.complete_store([2, 1])
    assert t.take_events() == [BlockStored([2], None, [], 0, "CPU"), BlockStored([1], None, [], 0, "CPU")]
    t.request_finished("A")  # tail first: 2 is the oldest
    assert store(t, "B", [3, 4], complete=False) == StoreOutput([3, 4], [0, 1], [2, 1])
    t.complete_store([3], success=False)
    assert t.take_events() == [BlockRemoved([2, 1], "CPU")]  # in eviction order
    t.complete_store([4])
    assert t.take_events() == [BlockStored([4], None, [], 0, "CPU")]
    assert t.take_events() == []
    off = HostTier(2)
    store(off, "A", [1, 2])
    assert (off.events, off.take_events()) == (None, [])


def _state(obj: object) -> object:
    """An object's attributes, followed into the objects it holds (for comparing a tier before and after);
    a dict as its items in order (an OrderedDict's order is the policy's state: ARC's lists, the offer counts)."""
    if isinstance(obj, dict):
        return [(k, _state(v)) for k, v in obj.items()]
    if isinstance(obj, list | tuple):
        return [_state(v) for v in obj]
    if hasattr(obj, "__dict__"):
        return (type(obj).__name__, _state(vars(obj)))
    return obj


@pytest.mark.parametrize("policy", OFFLOAD_POLICIES)
def test_an_offer_with_a_key_not_a_64_bit_hash_leaves_the_tier_as_it_was(policy: str):
    """Nothing half-written: the tier refuses the offer before its counts, its record of the
    request, its maps or its policy change (HostLRU packs a key into 64 bits)."""
    t = HostTier(3, policy, store_threshold=2)
    store(t, "A", [1, 2])
    store(t, "A", [1, 2])
    before = _state(t)
    for key in (-1, 2**64):
        with pytest.raises(ValueError, match="64-bit block hashes"):
            t.prepare_store("B", [3, 4, key], pos([3, 4, key]))
        assert _state(t) == before
    assert store(t, "B", [3, 4]).keys == []  # threshold 2: the refused offers were not counted
    out = store(t, "B", [3, 4])
    assert (out.keys, len(out.evicted)) == ([3, 4], 1)  # one slot free, one of A's chunks evicted
