"""The block record: one physical KV-cache block and its bookkeeping."""

from __future__ import annotations


class KVCacheBlock:
    """A block's id, reference count, cache key and free-queue links (vLLM V1's fields).

    `block_hash` is set while the block is full and registered in the prefix
    cache; it is dropped only when the block is popped for reuse (eviction).
    Eviction policies keep their own per-block data, keyed by `block_id`.
    `group` is the KV-cache group that cached it last (vLLM's hybrid groups share
    one pool; 0 in one group): an eviction is counted for that group, read off the
    block in hand rather than a table indexed by id, which costs a cache miss a block.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev", "next", "group")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.prev: KVCacheBlock | None = None
        self.next: KVCacheBlock | None = None
        self.group = 0

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"
