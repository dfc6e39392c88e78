"""Sliding-window attention: which blocks a request still needs, and window-aware cache hits.

Follows vLLM V1's SlidingWindowManager. A token at position p attends to
positions (p - window, p], so once `num_computed` tokens are computed, the
first `num_computed - window + 1` tokens are never read again and blocks
wholly inside that range go back to the pool (their place in the request's
table is taken by the null block).
"""

from __future__ import annotations

from kvcache.block import KVCacheBlock


def num_skipped_blocks(num_computed: int, window: int, block_size: int) -> int:
    return max(0, num_computed - window + 1) // block_size


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
