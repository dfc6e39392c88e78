"""The interface the block pool drives, and the base of every ranking policy.

A policy holds every free block (ref count 0), cached or not, and answers
`pop_n`. Its per-block data lives in the policy, in lists indexed by block id
and sized by `bind`; the pool reports what happens to blocks through the
`on_*` hooks and never writes policy state on the block.
"""

from __future__ import annotations

from kvsim.kvcache.block import KVCacheBlock
from kvsim.kvcache.free_queue import FreeBlockQueue


class EvictionPolicy:
    """Interface the block pool drives; the hooks default to doing nothing."""

    name = "base"

    def bind(self, num_blocks: int) -> None:
        """Size per-block state for block ids `0 .. num_blocks - 1` (the pool calls it once)."""

    def __len__(self) -> int:
        raise NotImplementedError

    def free(self, blocks: list[KVCacheBlock]) -> None:
        """Blocks whose ref count just reached 0, evict-first first."""
        raise NotImplementedError

    def free_first(self, blocks: list[KVCacheBlock]) -> None:
        """Uncached blocks whose ref count just reached 0, to be reused before any other
        free block, in their given order (vLLM 0.24+ `BlockPool.free_blocks`)."""
        raise NotImplementedError

    def remove(self, block: KVCacheBlock) -> None:
        """A free cached block was hit and is referenced again."""
        raise NotImplementedError

    def pop_n(self, n: int) -> list[KVCacheBlock]:
        """The next `n` blocks to reuse (the pool evicts their hashes)."""
        raise NotImplementedError

    def is_free(self, block: KVCacheBlock) -> bool:
        """True if `block` is in the free set (the invariant checker asks)."""
        raise NotImplementedError

    def is_pinned(self, block: KVCacheBlock) -> bool:
        """True if `block` stays cached outside the free set even when unreferenced."""
        return False

    def on_cache(self, block: KVCacheBlock, depth: int, chain: int) -> None:
        """`block` just became full and cached, as block `depth` of a prefix whose
        sequence has a `chain`-block prompt."""

    def on_hit(self, block: KVCacheBlock) -> None:
        """A prefix-cache hit on `block` (free or referenced)."""

    def on_evict(self, block: KVCacheBlock) -> None:
        """The pool is dropping `block`'s hash (it is being reused or the cache reset)."""


def overrides(policy: EvictionPolicy, hook: str) -> bool:
    """True if `policy` implements `hook` (so the pool's hot loops may skip the rest)."""
    return getattr(type(policy), hook) is not getattr(EvictionPolicy, hook)


class CachedPolicy(EvictionPolicy):
    """Uncached free blocks in a FIFO, consumed first; cached ones ranked by the subclass.

    Every policy but LRU follows this convention: a partial or hash-less block is
    never kept in preference to a full cached one. A subclass implements
    `_insert`, `_discard` and `_victim`; `tick[block_id]` is the stamp of a free
    cached block's live entry (-1 if it has none), for lazy deletion.
    """

    def __init__(self) -> None:
        self.plain = FreeBlockQueue()
        self.num_cached = 0
        self.tick: list[int] = []
        self._clock = 0

    def bind(self, num_blocks: int) -> None:
        self.tick = [-1] * num_blocks

    def __len__(self) -> int:
        return self.plain.num_free_blocks + self.num_cached

    def _stamp(self, block: KVCacheBlock) -> int:
        self._clock += 1
        self.tick[block.block_id] = self._clock
        return self._clock

    def free(self, blocks: list[KVCacheBlock]) -> None:
        for b in blocks:
            if b.block_hash is None:
                self.plain.append(b)
            else:
                self.num_cached += 1
                self._insert(b)

    def free_first(self, blocks: list[KVCacheBlock]) -> None:
        self.plain.prepend_n(blocks)

    def remove(self, block: KVCacheBlock) -> None:
        if self.tick[block.block_id] < 0:
            raise ValueError(f"block {block.block_id} is not free")
        self.num_cached -= 1
        self._discard(block)
        self.tick[block.block_id] = -1

    def pop_n(self, n: int) -> list[KVCacheBlock]:
        if n > len(self):
            raise ValueError(f"asked for {n} free blocks, only {len(self)} free")
        k = min(n, self.plain.num_free_blocks)
        out = self.plain.popleft_n(k)
        tick = self.tick
        for _ in range(n - k):
            b = self._victim()
            tick[b.block_id] = -1
            self.num_cached -= 1
            out.append(b)
        return out

    def is_free(self, block: KVCacheBlock) -> bool:
        """In the plain FIFO (linked, or on its front stack: a linear search) or ranked as cached."""
        return block.prev is not None or self.tick[block.block_id] >= 0 \
            or any(b is block for b in self.plain.stack)

    def _insert(self, block: KVCacheBlock) -> None:
        raise NotImplementedError

    def _discard(self, block: KVCacheBlock) -> None:
        """Default: lazy deletion (entries whose tick no longer matches are skipped)."""

    def _victim(self) -> KVCacheBlock:
        raise NotImplementedError
