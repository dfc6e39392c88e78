"""Blocks for KV a connector loads into vLLM 0.33's hybrid groups (kvcache/hybrid_loads.py), hand-worked.

vllm/v1/core/kv_cache_manager.py `allocate_slots` (num_external_computed_tokens, delay_cache_blocks),
kv_cache_coordinator.py `allocate_new_computed_blocks` (every group's hits touched before any group's
external blocks), single_type_kv_cache_manager.py `add_local_computed_blocks` and
`allocate_external_computed_blocks` (a window skips by the hit and the loaded tokens together);
kv_cache_manager.py `KVCacheBlocks.get_unhashed_block_ids_all_groups` (what the NIXL connector reads);
with Mamba state, kv_cache_manager.py `get_computed_blocks_for_connector` (the per-group lookup vLLM's NIXL
connector asks for: connector.py `supports_divergent_local_hybrid_hits`).
"""

from __future__ import annotations

import numpy as np
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
    # without Mamba state the connector's lookup is this one (`get_computed_blocks_for_connector`)
    assert m.get_computed_blocks_for_connector(b) == (hits, 24, False)
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


MAMBA = GroupSpec("mamba", 4)


def _divergent() -> tuple[HybridKVCacheManager, Sequence]:
    """9 usable blocks of 4; a (17 tokens) prefilled in chunks of 8 and 9, then freed: full attention
    cached blocks 1, 2, 4, 5 (16 tokens); the Mamba group the state after 8 tokens (block 3) only, the
    state after 17 ending mid-block (every state hashed: retention None)."""
    m = HybridKVCacheManager(10, [FULL, MAMBA], mamba_checkpoint_alignment=None, prefix_cache_retention_interval=None)
    a = _seq("a", range(17))
    m.allocate_slots(a, 8, 0, m.get_computed_blocks(a)[0])
    a.num_computed_tokens = 8
    m.new_step_starts()
    m.allocate_slots(a, 9)
    a.num_computed_tokens = 17
    assert (m.block_ids("a", 0), m.block_ids("a", 1)) == ([1, 2, 4, 5, 6], [0, 3, 0, 0, 7])
    m.free(a)
    return m, _seq("b", [*range(16), *range(900, 910)])


def test_full_attentions_deeper_hit_is_the_connectors_local_prefix_and_a_load_gives_mamba_one_state_block():
    # vllm/v1/core/kv_cache_manager.py `get_computed_blocks_for_connector` over kv_cache_coordinator.py
    # `find_longest_cache_hit_per_group`: b (26 tokens) hits 16 in full attention and 8 in the Mamba
    # group, each looked up alone: full attention's 16 with each group's own blocks, diverged; the
    # reconciled lookup (`get_computed_blocks`) agrees on 8
    m, b = _divergent()
    hits, hit, diverged = m.get_computed_blocks_for_connector(b)
    assert ([[x.block_id for x in h] for h in hits], hit, diverged) == ([[1, 2, 4, 5], [0, 3]], 16, True)
    rhits, rhit = m.get_computed_blocks(b)
    assert ([[x.block_id for x in h] for h in rhits], rhit) == ([[1, 2], [0, 3]], 8)
    # a load of 26 - 1 - 16 = 9 tokens (the NIXL connector's backoff of one): the check
    # (`MambaManager.get_num_blocks_to_allocate`) counts full attention's 3 new + 4 free hits and the
    # Mamba group's one new block + its free hit block: 9, one more than it takes, so 8 free fail
    assert m.allocate_for_load(b, hit, hits, 9, reserved=1) is None and m.num_free_blocks == 9
    new = m.allocate_for_load(b, hit, hits, 9)
    # the Mamba group skips 25 - 1 = 24 tokens (`get_num_skipped_tokens`): 6 nulls, its hit is never
    # taken (`add_local_computed_blocks`), and one new block holds the loaded state
    # (`allocate_external_computed_blocks`): what the connector reads, clipped to it
    # (base_scheduler.py `get_exchange_clipped_blocks`, `clip_ssm_state_blocks`)
    assert [x.block_id for x in new] == [7, 6, 8, 9]
    assert (m.block_ids("b", 0), m.block_ids("b", 1)) == ([1, 2, 4, 5, 7, 6, 8], [0] * 6 + [9])
    assert m.num_free_blocks == 1  # block 3, the Mamba hit, still free and cached


def test_a_lagging_group_hit_deeper_than_full_attention_falls_back_to_the_reconciled_hit():
    # c (24 tokens, 7 blocks) evicts full attention's block 2 (tokens 4-8) but not the Mamba state
    # after 8 (block 3): alone, full attention hits 4 and the Mamba group 8, deeper, so
    # `get_computed_blocks_for_connector` reconciles (`get_computed_blocks`): no Mamba state at or
    # below 4, hit 0, not diverged (taking full attention's 4 would have given 4)
    m, b = _divergent()
    c = _seq("c", range(500, 524))
    assert [x.block_id for x in m.allocate_slots(c, 24, 0, m.get_computed_blocks(c)[0])] == [7, 6, 8, 9, 5, 4, 2]
    hits, hit, diverged = m.get_computed_blocks_for_connector(b)
    assert (hits, hit, diverged) == (([], []), 0, False)


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
