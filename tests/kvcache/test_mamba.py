"""Mamba (gated-delta-net) groups in vLLM 0.33's "align" cache mode, hand-worked, each against the
vLLM function it follows:

- vllm/v1/core/sched/scheduler.py `Scheduler._mamba_block_aligned_split` (`aligned_chunk`), with
  vllm/v1/kv_cache_interface.py `get_mamba_prefill_checkpoint_position` and
  `is_mamba_prefill_checkpoint_valid`;
- vllm/v1/core/single_type_kv_cache_manager.py `MambaManager`: `find_longest_cache_hit`,
  `get_num_blocks_to_allocate` (the checkpoint block, `cached_blocks_this_step`),
  `allocate_new_blocks`, `remove_skipped_blocks`, `reachable_block_mask`.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvsim.kvcache.block import KVCacheBlock
from kvsim.kvcache.groups import GroupSpec, cached_ranges, find_longest_cache_hit
from kvsim.kvcache.hybrid import HybridKVCacheManager
from kvsim.kvcache.mamba import aligned_chunk, checkpoint_valid
from kvsim.kvcache.sequence import Sequence

NULL = KVCacheBlock(0)
MAMBA, FULL = GroupSpec("mamba", 4), GroupSpec("full", 4)


def _chunks(prompt: int, start: int, budget: int, bs: int, alignment: int | None, junction: int = 0,
            max_prefill: int = 2048) -> list[int]:
    """A prompt's chunks from `start`, each step's budget `budget`, the split applied."""
    out = []
    while start < prompt:
        n = aligned_chunk(start, min(budget, prompt - start), prompt, prompt, junction, bs, alignment, max_prefill)
        if n == 0:
            return out + [0]
        out.append(n)
        start += n
    return out


@pytest.mark.parametrize(("start", "junction", "triton", "flashinfer"), [
    (0, 0, [1632, 1088, 280], [1632, 1368]),  # no hit: chunk ends floored to 544, the last stop at 2,720
    (1088, 0, [1632, 280], [1912]),  # a hit of two blocks: FlashInfer exports the 2,720 state inside
    (1088, 2176, [1088, 544, 280], [1088, 824]),  # full attention hit deeper: the first chunk stops there
])
def test_the_block_aligned_split_of_a_3000_token_prompt_in_blocks_of_544(start, junction, triton, flashinfer):
    assert _chunks(3000, start, 2048, 544, None, junction) == triton
    assert _chunks(3000, start, 2048, 544, 544, junction) == flashinfer


def test_the_split_when_a_block_is_wider_than_the_chunk_limit_and_when_the_budget_falls_short():
    # long_prefill_token_threshold 256 < 544: chunks may end mid-block, and re-align at the next boundary
    assert _chunks(1200, 0, 256, 544, None, max_prefill=256)[:3] == [256, 256, 32]
    # 500 tokens left of a 2,048 budget cannot reach a boundary: nothing this step (the waiting loop breaks)
    assert aligned_chunk(0, 500, 3000, 3000, 0, 544, None, 2048) == 0
    # a decode is never split
    assert aligned_chunk(3000, 1, 3000, 3001, 0, 544, None, 2048) == 1


def test_a_checkpoint_is_exported_only_from_a_block_aligned_start_a_block_before_it():
    assert checkpoint_valid(1632, 3000, 2720, 544, 544)
    assert not checkpoint_valid(1632, 3000, 2720, 544, None)  # Triton's kernels export none
    assert not checkpoint_valid(2176, 2700, 2720, 544, 544)  # the checkpoint past the chunk
    assert not checkpoint_valid(100, 3000, 2720, 544, 544)  # a start mid-block


def test_a_mamba_hit_is_the_rightmost_cached_state_with_nulls_before_it():
    lookup = lambda i: [KVCacheBlock(100 + i)] if i in (0, 2) else None  # noqa: E731
    found, n = find_longest_cache_hit(MAMBA, 19, lookup, 1, NULL)  # blocks 0-3: 3 misses, 2 hits
    assert ([b.block_id for b in found[0]], n) == ([0, 0, 102], 12)
    assert find_longest_cache_hit(MAMBA, 19, lambda i: None, 1, NULL) == ([[]], 0)


def test_under_sparse_retention_a_mamba_group_hashes_the_replay_boundary_and_junction_states():
    # reachable_block_mask: block (b // 4 * 4) // 4 - 1 for each boundary; None: dense; 8: every other block
    assert cached_ranges(MAMBA, 0, 10, (37, 20), 0) == [(4, 5), (8, 9)]
    assert cached_ranges(MAMBA, 0, 10, (37,), None) == [(0, 10)]
    assert cached_ranges(MAMBA, 0, 10, (37,), 8) == [(1, 2), (3, 4), (5, 6), (7, 8), (8, 9), (9, 10)]


def _seq(sid: str, n: int, start: int = 0) -> Sequence:
    return Sequence(sid, np.arange(start, start + n, dtype=np.int64))


def _ids(blocks):
    return [b.block_id for b in blocks]


def test_a_prefill_takes_one_state_block_and_decodes_let_the_previous_state_go():
    m = HybridKVCacheManager(20, [MAMBA, FULL])
    s = _seq("a", 10)
    assert m.allocate_slots(s, 10) is not None
    mamba, full = m.tables[0]["a"], m.tables[1]["a"]
    # 3 blocks of slots: the state block only (block 2), nulls before; full attention holds all 3
    assert (_ids(mamba), len(full), m.pool.num_free_blocks) == ([0, 0, 1], 3, 15)
    s.num_computed_tokens = 10
    s.append_tokens(3)
    s.num_computed_tokens = 12
    m.allocate_slots(s, 1)  # the 13th token: a new state block; the old one still read by this step
    assert (_ids(mamba), m.pool.num_free_blocks) == ([0, 0, 1, 5], 13)
    s.num_computed_tokens = 13
    s.append_tokens(1)
    m.allocate_slots(s, 1)  # processed 13: the state of block 2 is no longer needed
    assert (_ids(mamba), m.pool.num_free_blocks) == ([0, 0, 0, 5], 14)


def test_a_checkpoint_block_holds_the_prompts_last_boundary_and_a_same_step_hit_waits():
    # FlashInfer's checkpoint (alignment 4): a 10-token prompt in one chunk keeps the state at 8 in
    # block 1 beside the running state in block 2, and hashes it (the replay boundary 9 floors to 8)
    m = HybridKVCacheManager(20, [MAMBA, FULL], mamba_checkpoint_alignment=4)
    a = _seq("a", 10)
    m.allocate_slots(a, 10)
    assert [b.block_id for b in m.tables[0]["a"]] == [0, 1, 2]
    assert m.tables[0]["a"][1].block_hash is not None and m.tables[0]["a"][2].block_hash is None
    b = _seq("b", 10)
    hits, hit = m.get_computed_blocks(b)
    assert (hit, _ids(hits[0])) == (8, [0, 1])
    assert m.allocate_slots(b, 2, hit, hits) is None  # hashed this step: vLLM refuses the allocation
    m.new_step_starts()
    assert m.allocate_slots(b, 2, hit, hits) is not None


def test_mamba_groups_refuse_what_vllm_runs_in_another_mode():
    with pytest.raises(ValueError, match="'none' cache mode"):
        HybridKVCacheManager(20, [MAMBA, FULL], enable_caching=False)


def test_a_window_and_a_mamba_state_let_go_in_the_same_step_go_back_in_group_order():
    # vLLM's coordinator calls each group's remove_skipped_blocks in group order. Window 6, blocks of 4:
    # at 13 computed tokens the window lets block 1 go ((13 - 5) // 4 = 2 blocks skipped) and the
    # Mamba group its state at 12 (block 2); both hashed (dense), so both join the back of the free
    # queue in that order: the Mamba group's (group 0) first
    m = HybridKVCacheManager(40, [MAMBA, GroupSpec("sliding_window", 4, 6), FULL], prefix_cache_retention_interval=None)
    s = _seq("a", 12)
    m.allocate_slots(s, 12)
    s.num_computed_tokens = 12
    s.append_tokens(1)
    m.allocate_slots(s, 1)
    state, window = m.tables[0]["a"][2], m.tables[1]["a"][1]
    s.num_computed_tokens = 13
    s.append_tokens(1)
    m.allocate_slots(s, 1)
    assert m.tables[0]["a"][2] is NULL_OF(m) and m.tables[1]["a"][1] is NULL_OF(m)
    assert _ids(m.next_free_blocks(m.pool.num_free_blocks))[-2:] == [state.block_id, window.block_id]


def NULL_OF(m):  # noqa: N802 - the manager's null block
    return m.null_block
