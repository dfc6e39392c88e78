"""Blocks for KV a connector loads into vLLM 0.33's hybrid groups (kvcache/hybrid_loads.py), hand-worked.

vllm/v1/core/kv_cache_manager.py `allocate_slots` (num_external_computed_tokens, delay_cache_blocks),
kv_cache_coordinator.py `allocate_new_computed_blocks` (every group's hits touched before any group's
external blocks), single_type_kv_cache_manager.py `add_local_computed_blocks` and
`allocate_external_computed_blocks` (a window skips by the hit and the loaded tokens together);
kv_cache_manager.py `KVCacheBlocks.get_unhashed_block_ids_all_groups` (what the NIXL connector reads).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsim.kvcache.groups import GroupSpec
from kvsim.kvcache.hybrid import HybridKVCacheManager
from kvsim.kvcache.sequence import Sequence

FULL, SW8 = GroupSpec("full", 4), GroupSpec("sliding_window", 4, 8)


def _seq(sid: str, tokens) -> Sequence:
    return Sequence(sid, np.asarray(tokens, dtype=np.int64))


def test_a_window_gets_nulls_for_what_it_skips_and_blocks_only_for_the_loaded_tokens_it_reads():
    # 26 tokens, none cached: full attention takes cdiv(26, 4) = 7 blocks; the window (8 tokens, blocks
    # of 4) skips 26 - 8 + 1 = 19 tokens = 4 whole blocks, so it takes 7 - 4 = 3 blocks after 4 nulls
    m = HybridKVCacheManager(64, [SW8, FULL])
    a = _seq("a", range(26))
    new = m.allocate_for_load(a, 0, m.empty_hit, 26)
    assert len(new) == 3 + 7 and m.num_held_blocks("a") == 10
    assert m.block_ids("a", 0)[:4] == [0, 0, 0, 0] and 0 not in m.block_ids("a", 0)[4:]
    assert len(m.block_ids("a", 0)) == len(m.block_ids("a", 1)) == 7
    assert m.num_free_blocks == 63 - 10
    assert all(b.block_hash is None for b in new)  # cached only once the load lands


def test_the_hit_blocks_are_taken_and_the_window_skips_by_hit_plus_loaded():
    # a cached 24-token prefix: b (30 tokens) hits 24 tokens (6 blocks) in each group and loads 6 more.
    # Full attention: its 6 hit blocks + cdiv(30, 4) - 6 = 2 new. The window skips 30 - 8 + 1 = 23
    # tokens = 5 blocks: its first 5 hit blocks become nulls, the 6th is taken, and 8 - 6 = 2 new
    m = HybridKVCacheManager(64, [SW8, FULL], prefix_cache_retention_interval=None)
    a = _seq("a", range(24))
    m.allocate_slots(a, 24, 0, m.get_computed_blocks(a)[0])
    m.free(a)
    b = _seq("b", [*range(24), *range(900, 906)])
    hits, hit = m.get_computed_blocks(b)
    assert hit == 24
    full_hit, window_hit = [x.block_id for x in hits[1]], [x.block_id for x in hits[0]]
    new = m.allocate_for_load(b, hit, hits, 6)
    assert len(new) == 2 + 2
    assert m.block_ids("b", 1)[:6] == full_hit
    assert m.block_ids("b", 0)[:6] == [0] * 5 + window_hit[5:] and len(m.block_ids("b", 0)) == 8
    assert m.num_held_blocks("b") == 6 + 2 + 1 + 2


def test_a_load_that_does_not_fit_changes_nothing():
    # 10 free blocks: a 26-token load needs 10 (its own) and the whole-sequence gate 10; reserved 1 fails it
    m = HybridKVCacheManager(11, [SW8, FULL])
    a = _seq("a", range(26))
    assert m.allocate_for_load(a, 0, m.empty_hit, 26, reserved=1) is None
    assert m.num_free_blocks == 10 and not m.holds_blocks("a")
    assert m.allocate_for_load(a, 0, m.empty_hit, 26) is not None and m.num_free_blocks == 0


def test_mamba_loads_are_refused():
    m = HybridKVCacheManager(64, [FULL, GroupSpec("mamba", 4)], mamba_checkpoint_alignment=None)
    with pytest.raises(ValueError, match="Mamba"):
        m.allocate_for_load(_seq("a", range(8)), 0, m.empty_hit, 8)


@settings(max_examples=200, deadline=None)
@given(window=st.integers(1, 70), prompt=st.integers(1, 400), bs=st.sampled_from([4, 16]))
def test_a_windows_new_blocks_never_exceed_the_nixl_clip(window, prompt, bs):
    """vLLM's NIXL connector clips a window's blocks to its last cdiv(window, bs) + 1
    (base_scheduler.py `blocks_per_sw`, `get_exchange_clipped_blocks`); the blocks a load gives a
    window are always within that, so the blocks read are the load's new blocks, unclipped."""
    m = HybridKVCacheManager(4 * (prompt // bs + 2), [GroupSpec("sliding_window", bs, window), GroupSpec("full", bs)])
    new = m.allocate_for_load(_seq("a", range(prompt)), 0, m.empty_hit, prompt)
    assert new is not None
    in_window = len(new) - -(-prompt // bs)
    assert in_window <= -(-window // bs) + 1
