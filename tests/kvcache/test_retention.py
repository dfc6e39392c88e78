"""Sparse prefix-cache retention of a sliding window (vLLM 0.33's `prefix_cache_retention_interval`).

Source, vLLM 0.33.0:
- vllm/config/cache.py `CacheConfig.prefix_cache_retention_interval`: default 0 (PR #52216);
- vllm/v1/core/kv_cache_coordinator.py `replay_boundaries` (no EAGLE: num_prompt_tokens - 1) and
  `KVCacheCoordinator.cache_blocks`, which hands the interval and the boundaries to each manager;
- vllm/v1/core/single_type_kv_cache_manager.py `SlidingWindowManager.reachable_block_mask`:
  None caches every block; 0 only the `cdiv(window - 1, block_size)`-block tail ending at the
  boundary rounded down to the alignment (the block size with one group); N > 0 also the tail of
  every N-token segment, or every block when a tail is as long as a segment.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsim.kvcache.manager import KVCacheManager
from kvsim.kvcache.sliding_window import contiguous_blocks_needed, retained_ranges
from tests.kvcache.conftest import prefill, seq


def test_retention_zero_keeps_only_the_tail_before_the_replay_boundary():
    # window 8, blocks of 4: a hit needs cdiv(7, 4) = 2 cached blocks in a row. A 30-token prompt's
    # replay boundary is token 29, block 7: blocks 5 and 6 are kept, 0-4 and 7 are not
    assert retained_ranges(0, 8, (30 - 1,), 8, 4, 0) == [(5, 7)]
    assert retained_ranges(0, 8, (30 - 1,), 8, 4, None) == [(0, 8)]  # dense
    # a 6-token prompt: boundary block 1, the tail starts at block 0 (max with the start)
    assert retained_ranges(0, 3, (6 - 1,), 8, 4, 0) == [(0, 1)]
    # a later call over blocks [6, 9) sees only what is left of the tail, then nothing past it
    assert retained_ranges(6, 9, (30 - 1,), 8, 4, 0) == [(6, 7)]
    assert retained_ranges(7, 12, (30 - 1,), 8, 4, 0) == []


def test_an_interval_adds_a_tail_to_every_segment():
    # interval 16 tokens = 4 blocks a segment, tail 2: blocks 2, 3, 6, 7, ... and the boundary's 5, 6
    assert retained_ranges(0, 12, (30 - 1,), 8, 4, 16) == [(2, 4), (5, 8), (10, 12)]
    # a tail as long as a segment: every block (interval 8 = 2 blocks, tail 2)
    assert retained_ranges(0, 12, (30 - 1,), 8, 4, 8) == [(0, 12)]


@given(st.integers(1, 200), st.integers(1, 64), st.sampled_from([1, 2, 4, 8, 16]), st.integers(0, 60),
       st.integers(0, 60), st.sampled_from([None, 0, 1, 2, 5]))
def test_kept_ranges_are_ordered_disjoint_and_inside_the_call(prompt, window, bs, start, width, segments):
    interval = None if segments is None else segments * bs
    ranges = retained_ranges(start, start + width, (prompt - 1,), window, bs, interval)
    flat = [i for a, b in ranges for i in range(a, b)]
    assert flat == sorted(set(flat)) and all(start <= i < start + width for i in flat)
    assert all(a < b for a, b in ranges)
    if interval is None:
        assert flat == list(range(start, start + width))
    boundary = (prompt - 1) // bs  # the replay tail is always kept where the call covers it
    need = contiguous_blocks_needed(window, bs)
    assert set(range(max(start, boundary - need), min(start + width, boundary))) <= set(flat)


def test_a_shared_system_prompt_past_a_long_first_turn_is_not_hashed():
    # The case: two first turns share a 12-token system prompt (3 blocks) and differ after.
    # Each prompt is 40 tokens, so its tail (blocks 7 and 8 of 10) is all a window of 8 hashes:
    # the second turn finds none of the system prompt's blocks; with dense retention it hits 12.
    def second_hit(retention):
        m = KVCacheManager(64, 4, sliding_window=8, prefix_cache_retention_interval=retention)
        system = list(range(12))
        a = seq("a", system + list(range(100, 128)))
        prefill(m, a)
        m.free(a)
        _, hit = m.get_computed_blocks(seq("b", system + list(range(200, 228)), uid=1))
        return hit

    assert (second_hit(0), second_hit(None)) == (0, 12)


def test_a_resend_of_the_same_prompt_still_hits_its_tail():
    m = KVCacheManager(64, 4, sliding_window=8)  # the default, 0
    a = seq("a", range(40))
    prefill(m, a)
    m.free(a)
    # a resend hits at most 39 tokens: blocks up to 9 (token 36); the window needs blocks 7 and 8,
    # which the boundary tail kept: 9 blocks hit (the ones before are null, out of the window)
    blocks, hit = m.get_computed_blocks(seq("b", range(40), uid=1))
    assert hit == 36 and [b.block_id != 0 for b in blocks] == [False] * 7 + [True, True]


def test_before_0_29_every_block_is_hashed_and_bad_intervals_are_refused():
    old = KVCacheManager(64, 4, sliding_window=8, vllm_version="0.28")
    assert old.retention_interval is None
    with pytest.raises(ValueError, match=r"prefix_cache_retention_interval \(6\) must be non-negative and a multiple"):
        KVCacheManager(64, 4, sliding_window=8, prefix_cache_retention_interval=6)
    with pytest.raises(ValueError, match="no sliding window, so retention has no effect"):
        KVCacheManager(64, 4, prefix_cache_retention_interval=8)
