"""Block-manager behaviour, vLLM V1 style: exact block ids, queue order and hits."""

import numpy as np
import pytest

from kvsim.kvcache.admission import AllocStatus
from kvsim.kvcache.block_pool import OutOfBlocksError
from kvsim.kvcache.invariants import check
from kvsim.kvcache.manager import KVCacheManager
from tests.kvcache.conftest import decode, prefill, seq


def queue(m):
    return m.pool.policy.queue.block_ids()


def ids(blocks):
    return [b.block_id for b in blocks]


def test_null_block_is_reserved(lru):
    # vllm/v1/core/block_pool.py BlockPool.__init__: block 0 is popped as the null block
    assert lru.pool.num_free_blocks == 9
    assert queue(lru) == list(range(1, 10))
    with pytest.raises(ValueError, match="at least 2"):
        KVCacheManager(1, 4)


def test_prefill_allocates_from_the_front_and_frees_tail_first(lru):
    a = seq("a", range(10))
    hit, new = prefill(lru, a)
    assert (hit, ids(new)) == (0, [1, 2, 3])
    assert queue(lru) == [4, 5, 6, 7, 8, 9]
    lru.free(a)
    # vLLM 0.33 (vllm/v1/core/block_pool.py BlockPool.free_blocks, since 0.24): the
    # uncached partial block 3 goes to the front, the cached ones to the back, tail
    # first, so the block ending the longest prefix is evicted first
    assert queue(lru) == [3, 4, 5, 6, 7, 8, 9, 2, 1]
    check(lru)


def test_release_023_appends_every_freed_block():
    m = KVCacheManager(10, 4, vllm_version="0.23")
    a = seq("a", range(10))
    prefill(m, a)
    m.free(a)
    # vLLM <= 0.23 BlockPool.free_blocks appended every freed block, tail first
    assert queue(m) == [4, 5, 6, 7, 8, 9, 3, 2, 1]


def test_uncached_blocks_freed_together_keep_their_order_at_the_front():
    # vllm/v1/core/kv_cache_utils.py FreeKVCacheBlockQueue.prepend_n: the first given
    # is reused first; with caching off every freed block goes to the front (0.28+)
    m = KVCacheManager(10, 4, enable_caching=False)
    a = seq("a", range(10))
    prefill(m, a)
    m.free(a)
    assert queue(m) == [3, 2, 1, 4, 5, 6, 7, 8, 9]
    b = seq("b", range(10), uid=1)
    prefill(m, b)
    assert m.block_ids("b") == [3, 2, 1]


def test_release_027_appends_freed_blocks_when_caching_is_off():
    # vLLM 0.27 BlockPool.free_blocks prepended only with prefix caching on
    m = KVCacheManager(10, 4, enable_caching=False, vllm_version="0.27")
    a = seq("a", range(10))
    prefill(m, a)
    m.free(a)
    assert queue(m) == [4, 5, 6, 7, 8, 9, 3, 2, 1]
    m = KVCacheManager(10, 4, vllm_version="0.27")
    a = seq("a", range(10))
    prefill(m, a)
    m.free(a)
    assert queue(m) == [3, 4, 5, 6, 7, 8, 9, 2, 1]


def test_reset_prefix_cache_only_when_nothing_is_used(lru):
    # vllm/v1/core/block_pool.py BlockPool.reset_prefix_cache: refused while any block
    # is in use; otherwise every hash is dropped and the free queue keeps its order
    a = seq("a", range(10))
    prefill(lru, a)
    assert lru.reset_prefix_cache() is False
    assert len(lru.pool.cached) == 2
    lru.free(a)
    assert lru.reset_prefix_cache() is True
    assert lru.pool.cached == {} and lru.pool.num_cached_free == 0
    assert queue(lru) == [3, 4, 5, 6, 7, 8, 9, 2, 1]
    assert lru.get_computed_blocks(seq("b", range(10), uid=1)) == ([], 0)
    check(lru)


def test_hit_on_free_blocks_takes_them_out_of_the_queue(lru):
    # vllm/v1/core/block_pool.py BlockPool.touch: a hit with ref count 0 leaves the free queue
    a = seq("a", range(10))
    prefill(lru, a)
    lru.free(a)
    b = seq("b", list(range(8)) + [99, 98, 97], uid=1)
    hit, new = prefill(lru, b)
    assert hit == 8
    # vllm/v1/core/block_pool.py BlockPool.touch unlinks the free hits 1 and 2; the new
    # block is the freed partial block 3, at the front since 0.24
    assert lru.block_ids("b") == [1, 2, 3]
    assert queue(lru) == [4, 5, 6, 7, 8, 9]
    check(lru)


def test_full_prompt_hit_recomputes_last_token(lru):
    # vllm/v1/core/kv_cache_manager.py get_computed_blocks: max_cache_hit_length = num_tokens - 1
    a = seq("a", range(8))
    prefill(lru, a)
    lru.free(a)
    b = seq("b", range(8), uid=1)
    blocks, hit = lru.get_computed_blocks(b)
    assert (ids(blocks), hit) == ([1], 4)


def test_popping_a_cached_block_evicts_its_hash(lru):
    # vllm/v1/core/block_pool.py get_new_blocks -> _maybe_evict_cached_block drops the hash
    a = seq("a", range(36))  # 9 blocks: the whole pool
    prefill(lru, a)
    lru.free(a)
    assert len(lru.pool.cached) == 9
    b = seq("b", range(100, 108), uid=1)
    _, new = prefill(lru, b)
    assert ids(new) == [9, 8]  # tail-first: the deepest blocks of a are reused first
    assert lru.pool.num_evictions == 2
    assert [(o.kind, o.a) for o in lru.ops.records() if o.kind == "evict"] == [("evict", 9), ("evict", 8)]
    assert lru.get_computed_blocks(seq("c", range(36), uid=2))[1] == 28
    check(lru)


def test_blocks_are_cached_when_decode_fills_them(lru):
    # vllm/v1/core/kv_cache_manager.py allocate_slots caches min(computed + new, num_tokens)
    # tokens' full blocks (BlockPool.cache_full_blocks), during prefill and decode alike
    a = seq("a", range(6), output=[50, 51, 52])
    prefill(lru, a)  # 7 tokens known (6 + first sampled), 6 computed
    assert lru.num_cached_block["a"] == 1
    decode(lru, a)  # computes token 6: block 1 holds 3 computed tokens
    assert lru.num_cached_block["a"] == 1
    decode(lru, a)  # computes token 7: block 1 full and cached
    assert lru.num_cached_block["a"] == 2
    lru.free(a)
    b = seq("b", [0, 1, 2, 3, 4, 5, 50, 51, 52], uid=1)
    assert lru.get_computed_blocks(b)[1] == 8


def test_unknown_decoded_tokens_never_hit(lru):
    a = seq("a", range(6))
    prefill(lru, a)
    decode(lru, a)
    lru.free(a)
    b = seq("b", list(range(6)) + [0, 0, 0], uid=1)
    assert lru.get_computed_blocks(b)[1] == 4


def test_identical_concurrent_blocks_are_both_cached(lru):
    # vllm/v1/core/block_pool.py BlockHashToBlockMap: no de-duplication; lookup takes the first
    a, b = seq("a", range(8)), seq("b", range(8), uid=1)
    prefill(lru, a)
    # b may hit only 1 block (its last token is recomputed), so it fills its own
    # copy of block 1: two blocks cached under one key, lookup returns the first
    prefill(lru, b)
    assert lru.block_ids("a") == [1, 2] and lru.block_ids("b") == [1, 3]
    key = lru.pool.blocks[2].block_hash
    assert key == lru.pool.blocks[3].block_hash
    assert sorted(lru.pool.cached[key]) == [2, 3]
    assert lru.get_computed_blocks(seq("c", range(9), uid=2))[0][1].block_id == 2
    lru.free(a)
    check(lru)


def test_admission_counts_evictable_hits(lru):
    # vllm/v1/core/single_type_kv_cache_manager.py get_num_blocks_to_allocate counts free hits
    a = seq("a", range(36))
    prefill(lru, a)
    lru.free(a)
    b = seq("b", range(36), uid=1)
    blocks, hit = lru.get_computed_blocks(b)
    assert hit == 32
    # 8 hit blocks sit in the free queue, plus 1 new block: all 9 free blocks
    assert lru.num_blocks_to_allocate(b, 36, blocks) == 9
    assert lru.allocate_slots(b, 4, hit, blocks) is not None
    assert lru.pool.num_free_blocks == 0
    check(lru)


def test_v1_watermark_applies_only_when_asked():
    m = KVCacheManager(11, 4, watermark=0.2)  # 2 blocks kept free
    assert m.watermark_blocks == 2
    a = seq("a", range(36))  # 9 of 10 free blocks would leave 1 < 2
    assert m.allocate_slots(a, 36, watermark=True) is None
    assert m.allocate_slots(a, 36, watermark=False) is not None
    b = seq("b", range(32), uid=1)  # 8 of 10 leaves exactly 2
    assert KVCacheManager(11, 4, watermark=0.2).allocate_slots(b, 32, watermark=True) is not None


def test_v2_can_allocate_ok_later_never():
    m = KVCacheManager(11, 4, watermark=0.2)
    assert m.can_allocate(seq("a", range(32))) is AllocStatus.OK
    assert m.can_allocate(seq("b", range(40))) is AllocStatus.NEVER
    m.allocate_slots(seq("c", range(20), uid=2), 20)
    assert m.can_allocate(seq("d", range(16), uid=3)) is AllocStatus.LATER


def test_lookahead_slots_are_allocated_not_cached(lru):
    a = seq("a", range(4))
    new = lru.allocate_slots(a, 4, num_lookahead_tokens=5)
    assert ids(new) == [1, 2, 3]
    assert lru.num_cached_block["a"] == 1


def test_fork_copies_the_shared_partial_block_on_write(lru):
    a = seq("a", range(6))
    prefill(lru, a)  # blocks 1, 2; block 2 holds tokens 4, 5
    b = lru.fork(a, "b", uid=1)
    assert lru.block_ids("b") == [1, 2]
    assert [blk.ref_cnt for blk in lru.req_blocks["a"]] == [2, 2]
    decode(lru, b)  # writes slot 2 of the shared block 2: copy first
    assert lru.block_ids("b") == [1, 3]
    copies = [(o.a, o.b) for o in lru.ops.records() if o.kind == "copy"]
    assert copies == [(2, 3)]
    decode(lru, a)  # a is now the only holder of block 2: writes in place
    assert lru.block_ids("a") == [1, 2]
    assert lru.num_cow_copies == 1
    check(lru)


def test_swap_out_and_in_round_trip():
    m = KVCacheManager(10, 4, num_cpu_blocks=4, record_ops=True, enable_caching=False)
    a = seq("a", range(6))
    prefill(m, a)
    assert m.swap_out([a]) == [(1, 0), (2, 1)]
    assert m.block_ids("a") == [] and m.swapped["a"] == [0, 1]
    assert m.pool.num_free_blocks == 9
    assert m.can_swap_in([a]) is AllocStatus.OK
    assert m.swap_in([a]) == [(0, 2), (1, 1)]  # freed tail first to the front (caching off)
    assert m.block_ids("a") == [2, 1]
    kinds = [(o.kind, o.a, o.b) for o in m.ops.records() if o.kind.startswith("swap")]
    assert kinds == [("swap_out", 1, 0), ("swap_out", 2, 1), ("swap_in", 0, 2), ("swap_in", 1, 1)]
    assert m.cpu.num_free_blocks == 4
    check(m)


def test_drop_swapped_returns_cpu_blocks():
    m = KVCacheManager(10, 4, num_cpu_blocks=4)
    a = seq("a", range(6))
    prefill(m, a)
    m.swap_out([a])
    m.drop_swapped(a)
    assert m.cpu.num_free_blocks == 4 and "a" not in m.swapped
    with pytest.raises(KeyError, match="'a' is not swapped out"):
        m.drop_swapped(a)
    check(m)


def test_failed_allocation_leaves_no_table():
    m = KVCacheManager(4, 4)
    assert m.allocate_slots(seq("a", range(20)), 20) is None
    assert "a" not in m.req_blocks


def test_a_one_token_admission_holding_blocks_must_fit_its_whole_sequence():
    # vllm 0.33 vllm/v1/core/kv_cache_manager.py allocate_slots: with full_sequence_must_fit
    # (the scheduler's scheduler_reserve_full_isl) the whole sequence is checked first, even
    # for a one-token chunk of a request that already holds blocks (one whose host-tier load
    # landed). a holds 2 blocks of its 20-token prompt; 1 of the 3 it still needs is free.
    m = KVCacheManager(6, 4)
    a, b = seq("a", range(20)), seq("b", range(100, 108))
    assert m.allocate_slots(a, 8) is not None and m.allocate_slots(b, 8) is not None
    a.num_computed_tokens = 8
    assert m.allocate_slots(a, 1, full_sequence_must_fit=True) is None
    assert (m.block_ids("a"), m.num_free_blocks) == ([1, 2], 1)
    assert len(m.allocate_slots(a, 1)) == 1  # without the gate the chunk's one block is enough


def test_a_windowed_admission_must_fit_its_window_and_a_step_not_its_whole_prompt():
    # vllm 0.33 vllm/v1/core/single_type_kv_cache_manager.py get_num_blocks_to_allocate
    # (apply_admission_cap) and vllm/v1/kv_cache_interface.py SlidingWindowSpec.
    # max_admission_blocks_per_request: a 40-token prompt (10 blocks) under an 8-token window
    # and an 8-token budget asks for cdiv(8 - 1 + 8, 4) + 1 = 5 free blocks, not 10
    def first_chunk(num_gpu_blocks: int, cap: int | None, held: int = 0):
        m = KVCacheManager(num_gpu_blocks, 4, sliding_window=8)
        m.admission_tokens = cap
        if held:
            assert m.allocate_slots(seq("b", range(100, 100 + 4 * held)), 4 * held) is not None
        return m.allocate_slots(seq("a", range(40)), 8, full_sequence_must_fit=True)

    assert len(first_chunk(7, 15)) == 2  # 6 free
    assert first_chunk(7, None) is None  # uncapped: all 10 blocks
    assert first_chunk(7, 15, held=3) is None  # 3 free: the chunk's 2 would fit, the window's 5 do not


def test_swap_in_reuses_blocks_still_cached_on_gpu():
    m = KVCacheManager(10, 4, num_cpu_blocks=4)
    a = seq("a", range(6))
    prefill(m, a)
    m.swap_out([a])
    assert m.swap_in([a]) == [(1, 2)]  # full block 1 still cached: touched, not copied
    assert m.block_ids("a") == [1, 2]
    check(m)


def test_sliding_window_returns_blocks_outside_the_window():
    m = KVCacheManager(20, 4, sliding_window=8)
    a = seq("a", range(20))
    prefill(m, a)
    for _ in range(4):
        decode(m, a)
    # the last decode started at 23 computed tokens: tokens < 23 - 8 + 1 = 16
    # are dead, so blocks 0..3 were freed; 6 blocks allocated in all
    assert m.block_ids("a")[:4] == [0, 0, 0, 0]
    assert len(m.block_ids("a")) == 6
    assert m.pool.num_free_blocks == 19 - 2
    check(m)


def test_under_async_output_a_window_lets_go_on_the_processed_tokens():
    # vllm/v1/core/kv_cache_manager.py KVCacheManager.allocate_slots (0.33): remove_skipped_blocks at
    # max(0, computed - num_in_flight_tokens). 24 computed, 8 of them in flight, window 8: blocks of
    # 16 - 7 = 9 processed tokens go (2 of 4 tokens), not of 24 - 7 = 17 (4)
    def run(in_flight: int) -> list[int]:
        m = KVCacheManager(20, 4, sliding_window=8)
        a = seq("a", range(24))
        prefill(m, a)
        a.append_tokens(1)
        assert m.allocate_slots(a, 1, in_flight=in_flight) is not None
        check(m)
        return m.block_ids("a")[:4]

    assert run(0) == [0, 0, 0, 0]
    assert run(8)[:2] == [0, 0] and 0 not in run(8)[2:]
    assert run(30) == run(24) and 0 not in run(24)  # nothing processed past the window yet


def test_errors_are_clear(lru):
    a = seq("a", range(4))
    with pytest.raises(KeyError, match="unknown sequence 'a'"):
        lru.free(a)
    prefill(lru, a)
    lru.free(a)
    with pytest.raises(KeyError):
        lru.free(a)
    with pytest.raises(ValueError, match="double free of block 1"):
        lru.pool.free_blocks([lru.pool.blocks[1]])
    with pytest.raises(OutOfBlocksError, match="asked for 10 blocks, only 9 free"):
        lru.pool.get_new_blocks(10)
    assert lru.allocate_slots(seq("big", range(40), uid=3), 40) is None


def test_shared_system_prompt_hits_992_tokens():
    m = KVCacheManager(4096, 16)
    rng = np.random.default_rng(0)
    system = rng.integers(0, 32000, 1000)
    hits = []
    for i in range(20):
        s = seq(f"r{i}", np.concatenate([system, rng.integers(0, 32000, 50)]), uid=i)
        hit, _ = prefill(m, s)
        for _ in range(10):
            decode(m, s)
        m.free(s)
        hits.append(hit)
    assert hits == [0] + [992] * 19
    assert m.pool.num_evictions == 0


def test_defragmenter_moves_high_blocks_down_and_tables_stay_valid():
    m = KVCacheManager(64, 4, defrag_threshold=4, record_ops=True, enable_caching=False)
    seqs = [seq(f"s{i}", range(8), uid=i) for i in range(10)]
    for s in seqs:
        prefill(m, s)  # 2 blocks each: ids 1..20
    for s in seqs[:8]:
        m.free(s)
    assert m.id_space_fragmentation() == 20 - 4
    moves = m.defragment()
    assert moves == [(20, 1), (19, 2), (18, 3), (17, 4)]
    # highest used first into the lowest holes: 20->1, 19->2, 18->3, 17->4
    assert m.physical_ids("s9") == [2, 1] and m.physical_ids("s8") == [4, 3]
    assert m.block_ids("s9") == [19, 20]
    assert m.id_space_fragmentation() == 0
    assert [(o.kind, o.a, o.b) for o in m.ops.records() if o.kind == "move"][:1] == [("move", 20, 1)]
    check(m)
