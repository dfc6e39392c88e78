"""Parallel sampling (v0/v2): forked sequences share blocks, copied on the first divergent write.

vLLM V1 fans out n > 1 in its front end; the v0/v2 block managers forked the
block table instead. The fork half of `KVCacheManager`; the manager decides
when a write needs a copy (`_needs_cow`) and calls `_copy_on_write`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvsim.kvcache.block import KVCacheBlock
from kvsim.kvcache.sequence import Sequence

if TYPE_CHECKING:
    from kvsim.kvcache.block_pool import BlockPool
    from kvsim.kvcache.ops import OpLog


class Forking:
    """The fork methods of `KVCacheManager` (mixed in); a copy is a `copy` op."""

    # set by KVCacheManager.__init__
    block_size: int
    pool: BlockPool
    null_block: KVCacheBlock
    ops: OpLog
    req_blocks: dict[str, list[KVCacheBlock]]
    num_cached_block: dict[str, int]
    num_cow_copies: int

    def fork(self, parent: Sequence, child_id: str, uid: int) -> Sequence:
        """A child sharing all of the parent's blocks; a later write into the
        shared partial last block copies it first (copy-on-write)."""
        if child_id in self.req_blocks:
            raise ValueError(f"sequence {child_id!r} already has blocks")
        blocks = self.req_blocks[parent.seq_id]
        for b in blocks:
            if b is not self.null_block:
                b.ref_cnt += 1
        child = parent.fork(child_id, uid)
        self.req_blocks[child_id] = list(blocks)
        if self.ops.enabled:
            self.ops.emit_table(child_id, blocks, 0)
        self.num_cached_block[child_id] = self.num_cached_block.get(parent.seq_id, 0)
        return child

    def _copy_on_write(self, seq: Sequence, blocks: list[KVCacheBlock]) -> None:
        """Give `seq` its own copy of the shared partial block its next write lands in."""
        i = seq.num_computed_tokens // self.block_size
        src = blocks[i]
        (dst,) = self.pool.get_new_blocks(1)
        self.ops.emit("copy", src.block_id, dst.block_id, seq=seq.seq_id)
        self.num_cow_copies += 1
        blocks[i] = dst
        if self.ops.enabled:
            self.ops.emit_entry(seq.seq_id, dst.block_id, i)
        self.pool.free_blocks([src])
