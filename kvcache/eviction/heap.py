"""Policies that rank free cached blocks by a key in a min-heap: LFU, FIFO and cost-aware."""

from __future__ import annotations

import heapq

from kvsim.kvcache.block import KVCacheBlock
from kvsim.kvcache.eviction.base import CachedPolicy


class _HeapPolicy(CachedPolicy):
    """Cached blocks in a min-heap of (key..., tick, block_id, block) with lazy deletion."""

    def __init__(self) -> None:
        super().__init__()
        self.heap: list[tuple] = []

    def _key(self, block: KVCacheBlock) -> tuple:
        raise NotImplementedError

    def _insert(self, block: KVCacheBlock) -> None:
        tick = self._stamp(block)
        heapq.heappush(self.heap, (*self._key(block), tick, block.block_id, block))
        if len(self.heap) > 2 * self.num_cached + 1024:  # drop stale entries
            live = self.tick
            self.heap = [e for e in self.heap if live[e[-2]] == e[-3]]
            heapq.heapify(self.heap)

    def _victim(self) -> KVCacheBlock:
        heap = self.heap
        live = self.tick
        while True:
            entry = heapq.heappop(heap)
            if live[entry[-2]] == entry[-3]:
                self._evicted(entry)
                return entry[-1]

    def _evicted(self, entry: tuple) -> None:
        """Hook: the live heap entry just chosen as victim."""


class LFU(_HeapPolicy):
    """Least frequently used (prefix-cache hits while cached); ties by recency."""

    name = "lfu"

    def __init__(self) -> None:
        super().__init__()
        self.hits: list[int] = []  # prefix-cache hits since the block was cached

    def bind(self, num_blocks: int) -> None:
        super().bind(num_blocks)
        self.hits = [0] * num_blocks

    def on_hit(self, block: KVCacheBlock) -> None:
        self.hits[block.block_id] += 1

    def on_evict(self, block: KVCacheBlock) -> None:
        self.hits[block.block_id] = 0

    def _key(self, block: KVCacheBlock) -> tuple:
        return (self.hits[block.block_id],)


class FIFO(_HeapPolicy):
    """First in, first out by the time a block was cached; hits do not matter."""

    name = "fifo"

    def __init__(self) -> None:
        super().__init__()
        self.born: list[int] = []  # when each block was cached (a count of cachings)
        self._born = 0

    def bind(self, num_blocks: int) -> None:
        super().bind(num_blocks)
        self.born = [0] * num_blocks

    def on_cache(self, block: KVCacheBlock, depth: int, chain: int) -> None:
        self._born += 1
        self.born[block.block_id] = self._born

    def _key(self, block: KVCacheBlock) -> tuple:
        return (self.born[block.block_id],)


class CostAware(LFU):
    """GreedyDual-Size-Frequency: keep blocks whose recomputation is dear.

    priority = L + (hits + 1) * (1 + chain * block_size / 1024), where
    `chain` is the prompt length (in blocks) of the request that cached the
    block (longer prompts cost more to recompute, attention being quadratic)
    and L is the priority of the last victim (ageing). Every block of a
    chain shares the factor and an ancestor has at least its descendants'
    hits, so with ties going deeper-first a prefix is trimmed from its tail:
    evicting a shallow block first would strand every block behind it.
    """

    name = "cost"

    def __init__(self, block_size: int = 16) -> None:
        super().__init__()
        self.scale = block_size / 1024
        self.age = 0.0
        self.depth: list[int] = []  # the block's index within the prefix it ends
        self.chain: list[int] = []  # prompt blocks of the sequence that cached it

    def bind(self, num_blocks: int) -> None:
        super().bind(num_blocks)
        self.depth = [0] * num_blocks
        self.chain = [0] * num_blocks

    def on_cache(self, block: KVCacheBlock, depth: int, chain: int) -> None:
        self.depth[block.block_id] = depth
        self.chain[block.block_id] = chain

    def _key(self, block: KVCacheBlock) -> tuple:
        i = block.block_id
        return (self.age + (self.hits[i] + 1) * (1.0 + self.chain[i] * self.scale), -self.depth[i])

    def _evicted(self, entry: tuple) -> None:
        self.age = entry[0]
