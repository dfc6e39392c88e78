"""LRU (vLLM V1's free-block queue, the default) and PinnedLRU (LRU that keeps pinned prefixes)."""

from __future__ import annotations

from kvsim.kvcache.block import KVCacheBlock
from kvsim.kvcache.eviction.base import EvictionPolicy
from kvsim.kvcache.free_queue import FreeBlockQueue


class LRU(EvictionPolicy):
    """Least recently used, exactly vLLM V1's free-block queue (the default).

    Freed cached blocks are appended (a finished request's tail block first) and,
    from vLLM 0.24, freed uncached blocks are put at the front (`free_first`).
    """

    name = "lru"

    def __init__(self) -> None:
        self.queue = FreeBlockQueue()

    def __len__(self) -> int:
        return self.queue.num_free_blocks

    def free(self, blocks: list[KVCacheBlock]) -> None:
        self.queue.append_n(blocks)

    def free_first(self, blocks: list[KVCacheBlock]) -> None:
        self.queue.prepend_n(blocks)

    def remove(self, block: KVCacheBlock) -> None:
        self.queue.remove(block)

    def pop_n(self, n: int) -> list[KVCacheBlock]:
        return self.queue.popleft_n(n)

    def is_free(self, block: KVCacheBlock) -> bool:
        """Linked in the queue, or on its front stack (a linear search there)."""
        return block.prev is not None or any(b is block for b in self.queue.stack)


class PinnedLRU(LRU):
    """LRU that never evicts pinned prefixes, up to `max_pinned` blocks.

    A block is pinned when its key was pinned explicitly (`pin_keys`) or, with
    `pin_after` > 0, once it has been hit that many times. An unreferenced
    pinned block stays cached outside the free queue, so it is not free.
    """

    name = "pinned"

    def __init__(self, max_pinned: int = 1024, pin_after: int = 2) -> None:
        super().__init__()
        self.max_pinned = max_pinned
        self.pin_after = pin_after
        self.keys: set[int] = set()
        self.pinned: set[int] = set()  # block ids; pinned for good (never freed, so never evicted)
        self.hits: list[int] = []  # prefix-cache hits since the block was cached

    @property
    def num_pinned(self) -> int:
        return len(self.pinned)

    def bind(self, num_blocks: int) -> None:
        self.hits = [0] * num_blocks

    def pin_keys(self, keys: list[int]) -> None:
        self.keys.update(keys)

    def is_pinned(self, block: KVCacheBlock) -> bool:
        return block.block_id in self.pinned

    def _maybe_pin(self, block: KVCacheBlock) -> None:
        if len(self.pinned) < self.max_pinned:
            self.pinned.add(block.block_id)

    def on_cache(self, block: KVCacheBlock, depth: int, chain: int) -> None:
        if block.block_hash in self.keys:
            self._maybe_pin(block)

    def on_hit(self, block: KVCacheBlock) -> None:
        self.hits[block.block_id] += 1
        if self.pin_after and self.hits[block.block_id] >= self.pin_after:
            self._maybe_pin(block)

    def on_evict(self, block: KVCacheBlock) -> None:
        self.hits[block.block_id] = 0

    def free(self, blocks: list[KVCacheBlock]) -> None:
        pinned = self.pinned
        self.queue.append_n([b for b in blocks if b.block_id not in pinned])

    def remove(self, block: KVCacheBlock) -> None:
        if block.block_id not in self.pinned:
            self.queue.remove(block)
