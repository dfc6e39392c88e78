"""Each eviction policy on a hand-built sequence of frees and hits."""

import pytest

from kvsim.kvcache.block import KVCacheBlock
from kvsim.kvcache.eviction import POLICIES, make_policy
from kvsim.kvcache.invariants import check
from kvsim.kvcache.manager import KVCacheManager
from tests.kvcache.conftest import prefill, seq


def run(policy: str, hits_on: list[int]) -> list[int]:
    """Cache one-block prompts A..D in a 5-block pool (block 5 stays unused and
    uncached), hit some, then allocate 3 blocks: which prompts are still cached?"""
    m = KVCacheManager(6, 4, eviction=policy)
    prompts = [list(range(100 * i, 100 * i + 4)) for i in range(4)]
    for uid, p in enumerate(prompts):
        s = seq(f"p{uid}", p, uid=uid)
        prefill(m, s)
        m.free(s)
    for k, i in enumerate(hits_on):
        s = seq(f"h{k}", prompts[i] + [7], uid=10 + k)
        blocks, hit = m.get_computed_blocks(s)
        assert m.allocate_slots(s, 0, hit, blocks) == []  # a hit that allocates nothing
        m.free(s)
    prefill(m, seq("new", range(1000, 1012), uid=99))
    check(m)
    return [i for i, p in enumerate(prompts) if m.get_computed_blocks(seq("q", p + [7], uid=98))[1] == 4]


def test_lru_evicts_least_recent():
    # free queue [5, B, C, D, A]: the unused block, then B and C go
    assert run("lru", [0]) == [0, 3]


def test_lfu_evicts_least_hit_then_oldest():
    assert run("lfu", [3, 3, 0]) == [0, 3]


def test_fifo_ignores_hits():
    assert run("fifo", [0, 0, 0]) == [2, 3]


def test_s3fifo_evicts_from_the_small_queue_first():
    # all four sit in the small queue; the hit re-queues A at its tail
    assert run("s3fifo", [0]) == [0, 3]


def test_cost_aware_keeps_frequently_hit_blocks():
    assert run("cost", [1, 1, 2]) == [1, 2]


def test_pinned_prefix_survives_pressure():
    m = KVCacheManager(6, 4, eviction="pinned")
    m.pool.policy.pin_keys(seq("x", range(5)).hashes_upto(4, 4))
    a = seq("a", range(5))
    prefill(m, a)
    m.free(a)
    assert m.pool.num_free_blocks == 4  # pinned idle block is not free
    for i in range(6):
        s = seq(f"f{i}", range(50 * (i + 1), 50 * (i + 1) + 8), uid=i + 1)
        prefill(m, s)
        m.free(s)
    assert m.get_computed_blocks(seq("b", range(5), uid=99))[1] == 4
    check(m)


def test_uncached_free_blocks_are_reused_before_cached_ones():
    for name in ("lfu", "fifo", "s3fifo", "cost"):
        m = KVCacheManager(6, 4, eviction=name)
        a = seq("a", range(6))  # one full cached block, one partial
        prefill(m, a)
        m.free(a)
        b = seq("b", range(50, 53), uid=1)
        prefill(m, b)
        assert m.get_computed_blocks(seq("c", range(6), uid=2))[1] == 4, name


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown eviction policy 'lruu'; choose from lru, lfu"):
        make_policy("lruu")
    assert set(POLICIES) == {"lru", "lfu", "fifo", "s3fifo", "cost", "pinned", "arc"}


def test_cost_aware_trims_a_prefix_from_its_tail():
    # one 8-block prompt cached in a 10-block pool; a 3-block request must evict 1
    # block: the deepest, so the other 7 still form a reachable prefix
    m = KVCacheManager(11, 4, eviction="cost")
    long = seq("long", range(33))
    prefill(m, long)
    m.free(long)
    prefill(m, seq("other", range(500, 512), uid=1))
    assert m.get_computed_blocks(seq("again", range(33), uid=2))[1] == 28


def test_a_block_carries_only_vllms_fields():
    # every policy keeps its per-block data itself, keyed by block id; `group` is the group id vLLM
    # 0.33 keeps in the block's key (vllm/v1/core/kv_cache_utils.py: `KVCacheBlock._block_hash` is a
    # `BlockHashWithGroupId`, `make_block_hash_with_group_id`), which kvsim's salted key cannot give back
    assert KVCacheBlock.__slots__ == ("block_id", "ref_cnt", "block_hash", "prev", "next", "group")
    for name in POLICIES:
        m = KVCacheManager(6, 4, eviction=name)
        a = seq("a", range(9))
        prefill(m, a)
        m.free(a)
        assert m.get_computed_blocks(seq("b", range(9), uid=1))[1] == 8, name
        check(m)
