"""vLLM's KV events from the block manager (kvcache.events): exact events for a hit, an eviction, a
reset, and a hybrid window group caching under sparse retention."""

import json

import numpy as np

from kvsim.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvsim.kvcache.groups import GroupSpec, group_salt
from kvsim.kvcache.hashing import block_keys, unique_keys
from kvsim.kvcache.hybrid import HybridKVCacheManager
from kvsim.kvcache.manager import KVCacheManager
from tests.kvcache.conftest import decode, prefill, seq

A = block_keys(list(range(10)), 4)  # a's two full blocks
C = block_keys(list(range(100, 113)), 4)


def test_keys_are_kvsims_stable_hashes() -> None:
    assert A == [4581406666015525333, 11780669733817813327]


def test_events_are_off_by_default() -> None:
    m = KVCacheManager(5, 4)
    prefill(m, seq("a", range(10)))
    assert (m.emits_events, m.take_events(), m.pool.events) == (False, [], None)


def test_a_store_a_hit_a_decode_an_eviction_and_a_reset() -> None:
    m = KVCacheManager(5, 4, kv_events=True)
    a = seq("a", range(10))
    prefill(m, a)
    # vllm/v1/core/block_pool.py cache_full_blocks: one event for the call, no parent at block 0
    assert m.take_events() == [BlockStored(A, None, list(range(8)), 4, "GPU", 0)]
    assert m.take_events() == []  # taken: the queue starts again
    m.free(a)
    b = seq("b", [*range(8), 50, 51, 52], uid=1)
    assert prefill(m, b)[0] == 8  # a hit caches nothing new: no event (kv_cache_report_mode "incremental")
    assert m.take_events() == []
    decode(m, b)  # its token at position 11 fills block 2: parent is block 1's hash
    (b2,) = unique_keys(1, 2, 3)  # (a block holding a unique decoded token: kvcache.hashing)
    assert m.take_events() == [BlockStored([b2], A[1], [50, 51, 52, -(1 + (1 << 24 | 11))], 4, "GPU", 0)]
    m.free(b)
    assert m.pool.policy.queue.block_ids() == [4, 3, 2, 1]
    c = seq("c", range(100, 113), uid=2)
    prefill(m, c)  # four blocks: block 4 was never cached, blocks 3, 2, 1 are evicted in queue order
    assert m.take_events() == [BlockRemoved([b2]), BlockRemoved([A[1]]), BlockRemoved([A[0]]),
                               BlockStored(C, None, list(range(100, 112)), 4)]
    m.free(c)
    assert m.reset_prefix_cache()
    assert m.take_events() == [AllBlocksCleared()]


def test_a_window_group_under_sparse_retention_carries_group_free_hashes() -> None:
    m = HybridKVCacheManager(12, [GroupSpec("full", 4), GroupSpec("sliding_window", 4, 8)], kv_events=True)
    a = seq("a", range(18))
    blocks, hit = m.get_computed_blocks(a)
    m.allocate_slots(a, 18, hit, blocks)
    keys = block_keys(list(range(18)), 4)
    # retention 0: the window group hashes only the tail a replay from token 17 reads (blocks 2, 3),
    # but its event covers the call's whole token range, as vLLM's masked cache_full_blocks does
    assert m.take_events() == [BlockStored(keys, None, list(range(16)), 4, "GPU", 0),
                               BlockStored(keys[2:], None, list(range(16)), 4, "GPU", 1)]
    assert m.pool.blocks[8].block_hash == keys[2] ^ group_salt(1)  # the pool's key is salted, the event's not
    m.free(a)
    b = seq("b", range(100, 120), uid=1)
    blocks, hit = m.get_computed_blocks(b)
    m.allocate_slots(b, 20, hit, blocks)
    k = block_keys(list(range(100, 120)), 4)
    assert m.take_events() == [BlockRemoved([keys[3]], "GPU", 0), BlockRemoved([keys[2]], "GPU", 0),
                               BlockRemoved([keys[1]], "GPU", 0), BlockRemoved([keys[0]], "GPU", 0),
                               BlockRemoved([keys[3]], "GPU", 1),
                               BlockStored(k, None, list(range(100, 120)), 4, "GPU", 0),
                               BlockStored(k[2:4], None, list(range(100, 120)), 4, "GPU", 1)]


def test_a_batch_is_one_json_line_in_vllms_field_names() -> None:
    batch = EventBatch(1.5, 0, 3, [BlockStored([7, 8], 6, [1, 2], 1), BlockRemoved([5], "GPU", 1), AllBlocksCleared()])
    assert json.loads(batch.json_line()) == {"ts": 1.5, "replica": 0, "step": 3, "events": [
        {"type": "BlockStored", "block_hashes": [7, 8], "parent_block_hash": 6, "token_ids": [1, 2],
         "block_size": 1, "medium": "GPU", "group_idx": 0},
        {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU", "group_idx": 1},
        {"type": "AllBlocksCleared"}]}
    assert batch.json_line().count("\n") == 1


def test_a_stored_events_token_ids_are_read_only_when_asked_for() -> None:
    """`TokenSpan`: a prompt's ids are listed from its sequence only when the event is written or
    compared (a router reads only the hashes); the list then equals the sequence's ids, decoded
    stand-ins included, however many tokens the sequence has decoded since."""
    from kvsim.kvcache.events import TokenSpan
    from kvsim.kvcache.sequence import Sequence

    class Counted(Sequence):
        __slots__ = ("reads",)

        def token_ids(self, start: int, end: int):
            self.reads += 1
            return super().token_ids(start, end)

    s = Counted("a", np.arange(6), uid=3)
    s.reads = 0
    span = TokenSpan(s, 4, 8)
    s.append_tokens(5)  # decoded on: the span's positions keep their ids
    event = BlockStored([1], None, span, 4)
    assert (len(span), s.reads) == (4, 0)  # its length needs no ids
    want = [4, 5, -(1 + (3 << 24 | 6)), -(1 + (3 << 24 | 7))]
    assert event.as_dict()["token_ids"] == want and s.reads == 1
    assert event == BlockStored([1], None, want, 4) and span == TokenSpan(s, 4, 8) and s.reads == 2
    assert list(span) == want and span[2] == want[2] and repr(span) == repr(want) and s.reads == 2
    assert span != [4, 5] and span != tuple(want)
