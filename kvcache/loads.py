"""Slots for KV loaded from the host tier (vLLM 0.33's async KV loads); mixed into `KVCacheManager`.

A request whose prefix continues in the host tier gets GPU blocks for its local
hit plus the loaded tokens at once; the blocks are written by the load (no
`write` ops) and cached only when it completes (vllm/v1/core/kv_cache_manager.py
`allocate_slots` with `num_external_computed_tokens` and `delay_cache_blocks`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvsim.kvcache.block import KVCacheBlock
from kvsim.kvcache.sequence import Sequence

if TYPE_CHECKING:
    from kvsim.kvcache.block_pool import BlockPool
    from kvsim.kvcache.ops import OpLog


class Loads:
    """The load methods of `KVCacheManager` (mixed in)."""

    # set by KVCacheManager.__init__
    block_size: int
    pool: BlockPool
    ops: OpLog
    enable_caching: bool
    sliding_window: int | None
    watermark_blocks: int
    req_blocks: dict[str, list[KVCacheBlock]]
    num_cached_block: dict[str, int]

    def allocate_for_load(self, seq: Sequence, hit: int, hit_blocks: list[KVCacheBlock], loaded: int, *,
                          reserved: int = 0, watermark: bool = False, whole: bool = True) -> list[KVCacheBlock] | None:
        """Blocks for `seq`'s `hit` cached tokens (`hit_blocks`) and the next `loaded` tokens, none
        computed here; None (nothing changes) unless the whole sequence fits the free blocks (plus
        the watermark; not asked when `whole` is False: scheduler_reserve_full_isl off) and this
        allocation fits them less `reserved` (blocks other in-flight prefills still need). Returns
        the new blocks: the load's destinations."""
        if self.sliding_window is not None:
            raise ValueError("loads from the host tier need full attention (no sliding window)")
        if seq.seq_id in self.req_blocks:
            raise ValueError(f"{seq.seq_id}: already holds blocks")
        free = self.pool.num_free_blocks
        mark = self.watermark_blocks if watermark else 0
        if whole and self.num_blocks_to_allocate(seq, seq.num_tokens, hit_blocks) + mark > free:
            return None
        if self.num_blocks_to_allocate(seq, hit + loaded, hit_blocks) + mark > free - reserved:
            return None
        if self.enable_caching:
            self.pool.touch(hit_blocks)
        blocks = self.req_blocks[seq.seq_id] = list(hit_blocks)
        self.num_cached_block[seq.seq_id] = len(hit_blocks)
        bs = self.block_size
        new = self.pool.get_new_blocks(-(-(hit + loaded) // bs) - len(blocks))
        blocks.extend(new)
        if self.ops.enabled:
            self.ops.emit_table(seq.seq_id, blocks)
        return new

    def blocks_to_finish(self, seq: Sequence) -> int:
        """Blocks `seq` still needs to hold all its known tokens (vLLM `_request_remaining_blocks`)."""
        return self.num_blocks_to_allocate(seq, seq.num_tokens)

    def num_held_blocks(self, seq_id: str) -> int:
        """The blocks `seq_id` holds, null blocks (a window's skipped) not counted."""
        blocks = self.req_blocks.get(seq_id, ())
        if self.sliding_window is None:  # only a window puts null blocks in a table
            return len(blocks)
        null = self.pool.null_block
        return sum(1 for b in blocks if b is not null)
