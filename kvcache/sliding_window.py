"""Sliding-window attention: which blocks a request still needs, and window-aware cache hits.

Follows vLLM V1's SlidingWindowManager. A token at position p attends to
positions (p - window, p], so once `num_computed` tokens are computed, the
first `num_computed - window + 1` tokens are never read again and blocks
wholly inside that range go back to the pool (their place in the request's
table is taken by the null block).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvsim.kvcache.block import KVCacheBlock


def num_skipped_blocks(num_computed: int, window: int, block_size: int) -> int:
    return max(0, num_computed - window + 1) // block_size


def null_skipped(blocks: list[KVCacheBlock], num_computed: int, window: int, block_size: int,
                 null: KVCacheBlock) -> dict[int, KVCacheBlock]:
    """Put the null block in place of the blocks the window no longer reads, from the last of
    them back to the first one already null; returns the blocks taken out by index, last first."""
    removed = {}
    for i in range(min(num_skipped_blocks(num_computed, window, block_size), len(blocks)) - 1, -1, -1):
        if blocks[i] is null:
            break
        removed[i] = blocks[i]
        blocks[i] = null
    return removed


def contiguous_blocks_needed(window: int, block_size: int) -> int:
    """Cached blocks in a row that a window-length cache hit needs."""
    return -(-(window - 1) // block_size)


def find_longest_cache_hit(hashes: list[int], max_blocks: int, window: int, block_size: int,
                           get_cached, null_block: KVCacheBlock) -> list[KVCacheBlock]:
    """Scan from the right for `contiguous_blocks_needed` hits in a row; blocks
    before that run are null (outside the window). Without such a run only a
    run starting at block 0 counts."""
    need = contiguous_blocks_needed(window, block_size)
    out = [null_block] * max_blocks
    run = 0
    for i in range(max_blocks - 1, -1, -1):
        b = get_cached(hashes[i])
        if b is None:
            run = 0
            continue
        out[i] = b
        run += 1
        if run >= need:
            return out[: i + run]
    return out[:run]


def admission_blocks(num_tokens: int, cap_tokens: int | None, window: int, block_size: int,
                     held: Sequence[KVCacheBlock], hits: list[KVCacheBlock], num_computed: int,
                     free_hits: Callable[[list[KVCacheBlock], bool], int]) -> int:
    """Free blocks vLLM 0.33's whole-sequence admission gate asks of a windowed request
    (vllm/v1/core/single_type_kv_cache_manager.py get_num_blocks_to_allocate with
    apply_admission_cap): blocks for all `num_tokens`, but at most those of `cap_tokens` plus
    one (vllm/v1/kv_cache_interface.py SlidingWindowSpec.max_admission_blocks_per_request: the
    window and a step's tokens), less the blocks it holds or hits or that the window skips,
    plus its hits sitting in the free queue (`free_hits`, nulls allowed)."""
    need = -(-num_tokens // block_size)
    if cap_tokens is not None:
        need = min(need, -(-cap_tokens // block_size) + 1)
    skipped = num_skipped_blocks(num_computed, window, block_size)
    return max(need - max(skipped, len(hits) + len(held)), 0) + free_hits(hits[max(0, skipped - len(held)):], True)


def retained_ranges(start: int, end: int, boundaries: Sequence[int], window: int, block_size: int,
                    retention_interval: int | None) -> list[tuple[int, int]]:
    """Which of a request's just-filled blocks [start, end) a sliding-window group hashes for the
    prefix cache, as vLLM 0.33's `SlidingWindowManager.reachable_block_mask`
    (vllm/v1/core/single_type_kv_cache_manager.py) decides with `prefix_cache_retention_interval`
    (`KVCacheCoordinator.cache_blocks` passes it; no EAGLE, hits aligned to the block size):

    - None (dense): every block;
    - 0 (vLLM's default, `vllm/config/cache.py`): only the tails a later request can resume from,
      the `contiguous_blocks_needed` blocks ending at each of `boundaries` rounded down to a block:
      the replay boundary, the prompt's last token (`kv_cache_coordinator.py replay_boundaries`: a
      resend hits at most num_prompt_tokens - 1), and with several groups the shared-prefix
      junction found at lookup (`SingleTypeKVCacheManager.cache_blocks`; a single group reports
      none);
    - N > 0: that tail, and the tail of every N-token segment (all blocks when a hit's run
      is as long as a segment).

    The others stay unhashed: they never serve a hit, and they go back to the front of the free
    queue. Returns the kept blocks as [a, b) ranges, in order.
    """
    if retention_interval is None:
        return [(start, end)] if start < end else []
    need = contiguous_blocks_needed(window, block_size)
    keep = [False] * (end - start)
    if retention_interval > 0:
        per_segment = retention_interval // block_size
        if need >= per_segment:
            return [(start, end)] if start < end else []
        for i in range(start, end):
            if i % per_segment >= per_segment - need:
                keep[i - start] = True
    for position in boundaries:
        boundary = position // block_size  # in blocks: the tail ends there
        for j in range(max(start, boundary - need), min(end, boundary)):
            keep[j - start] = True
    ranges: list[tuple[int, int]] = []
    i = 0
    while i < len(keep):
        if keep[i]:
            j = i
            while j < len(keep) and keep[j]:
                j += 1
            ranges.append((start + i, start + j))
            i = j
        else:
            i += 1
    return ranges
