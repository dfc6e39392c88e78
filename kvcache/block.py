"""The block record: one physical KV-cache block and its bookkeeping."""

from __future__ import annotations


class KVCacheBlock:
    """A block's id, reference count, cache key and free-queue links.

    `block_hash` is set while the block is full and registered in the prefix
    cache; it is dropped only when the block is popped for reuse (eviction).
    `depth` is the block's index within the prefix it ends (for cost-aware
    eviction); the remaining fields are eviction-policy bookkeeping.
    """

    __slots__ = (
        "block_id", "ref_cnt", "block_hash", "prev", "next",
        "depth", "chain", "hits", "freq", "tick", "born", "where", "pinned",
    )

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.prev: KVCacheBlock | None = None
        self.next: KVCacheBlock | None = None
        self.depth = 0
        self.chain = 0  # prompt blocks of the sequence that cached it (how dear its prefix is)
        self.hits = 0  # prefix-cache hits since the block was cached
        self.freq = 0  # S3-FIFO's small access counter
        self.tick = -1  # policy bookkeeping: stamp of the block's live entry, -1 if none
        self.born = 0  # when the block was cached (FIFO order)
        self.where = 0  # S3-FIFO queue: 0 none, 1 small, 2 main
        self.pinned = False

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"
