"""Eviction policies: which free block is reused next.

A policy holds every free block (ref count 0), cached or not, and answers
`pop_n`. LRU is vLLM V1 exactly: one queue, reuse from the front; freed
cached blocks are appended (a finished request's tail block first) and, from
vLLM 0.24, freed uncached blocks are put at the front (`free_first`). Every
other policy reuses uncached free blocks first (a partial or hash-less block
is never kept in preference to a full cached one) and ranks only the cached,
evictable blocks.

To add a policy: subclass `CachedPolicy`, implement `_insert`, `_discard` and
`_victim`, add it to `POLICIES`, and write one test.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque

from kvcache.block import KVCacheBlock
from kvcache.free_queue import FreeBlockQueue


class EvictionPolicy:
    """Interface the block pool drives."""

    name = "base"

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

    def on_hit(self, block: KVCacheBlock) -> None:
        """A prefix-cache hit on `block` (free or referenced)."""
        block.hits += 1

    def on_cache(self, block: KVCacheBlock) -> None:
        """`block` just became full and cached."""

    def is_free(self, block: KVCacheBlock) -> bool:
        raise NotImplementedError


class LRU(EvictionPolicy):
    """Least recently used, exactly vLLM V1's free-block queue (the default)."""

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
        return block.prev is not None


class CachedPolicy(EvictionPolicy):
    """Uncached free blocks in a FIFO, consumed first; cached ones ranked by the subclass."""

    def __init__(self) -> None:
        self.plain = FreeBlockQueue()
        self.num_cached = 0
        self._clock = 0

    def __len__(self) -> int:
        return self.plain.num_free_blocks + self.num_cached

    def _stamp(self, block: KVCacheBlock) -> int:
        self._clock += 1
        block.tick = self._clock
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
        if block.tick < 0:
            raise ValueError(f"block {block.block_id} is not free")
        self.num_cached -= 1
        self._discard(block)
        block.tick = -1

    def pop_n(self, n: int) -> list[KVCacheBlock]:
        if n > len(self):
            raise ValueError(f"asked for {n} free blocks, only {len(self)} free")
        k = min(n, self.plain.num_free_blocks)
        out = self.plain.popleft_n(k)
        for _ in range(n - k):
            b = self._victim()
            b.tick = -1
            self.num_cached -= 1
            out.append(b)
        return out

    def is_free(self, block: KVCacheBlock) -> bool:
        return block.prev is not None or block.tick >= 0

    def _insert(self, block: KVCacheBlock) -> None:
        raise NotImplementedError

    def _discard(self, block: KVCacheBlock) -> None:
        """Default: lazy deletion (heap entries whose tick no longer matches are skipped)."""

    def _victim(self) -> KVCacheBlock:
        raise NotImplementedError


class _HeapPolicy(CachedPolicy):
    """Cached blocks in a min-heap of (key..., tick, block) with lazy deletion."""

    def __init__(self) -> None:
        super().__init__()
        self.heap: list[tuple] = []

    def _key(self, block: KVCacheBlock) -> tuple:
        raise NotImplementedError

    def _insert(self, block: KVCacheBlock) -> None:
        tick = self._stamp(block)
        heapq.heappush(self.heap, (*self._key(block), tick, block.block_id, block))
        if len(self.heap) > 2 * self.num_cached + 1024:  # drop stale entries
            self.heap = [e for e in self.heap if e[-1].tick == e[-3]]
            heapq.heapify(self.heap)

    def _victim(self) -> KVCacheBlock:
        heap = self.heap
        while True:
            entry = heapq.heappop(heap)
            if entry[-1].tick == entry[-3]:
                self._evicted(entry)
                return entry[-1]

    def _evicted(self, entry: tuple) -> None:
        """Hook: the live heap entry just chosen as victim."""


class LFU(_HeapPolicy):
    """Least frequently used (prefix-cache hits while cached); ties by recency."""

    name = "lfu"

    def _key(self, block: KVCacheBlock) -> tuple:
        return (block.hits,)


class FIFO(_HeapPolicy):
    """First in, first out by the time a block was cached; hits do not matter."""

    name = "fifo"

    def _key(self, block: KVCacheBlock) -> tuple:
        return (block.born,)


class CostAware(_HeapPolicy):
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

    def _key(self, block: KVCacheBlock) -> tuple:
        return (self.age + (block.hits + 1) * (1.0 + block.chain * self.scale), -block.depth)

    def _evicted(self, entry: tuple) -> None:
        self.age = entry[0]


class S3FIFO(CachedPolicy):
    """S3-FIFO (Yang et al., SOSP'23): a small probationary FIFO, a main FIFO and a ghost list.

    New cached blocks enter the small queue (or main, if their key is a ghost);
    a block hit while queued is promoted from small to main, and gets another
    lap in main; blocks evicted from small leave their key in the ghost list.
    """

    name = "s3fifo"

    def __init__(self, small_fraction: float = 0.1) -> None:
        super().__init__()
        self.small_fraction = small_fraction
        self.small: deque = deque()
        self.main: deque = deque()
        self.n_small = 0
        self.n_main = 0
        self.ghost: OrderedDict[int, None] = OrderedDict()

    def on_hit(self, block: KVCacheBlock) -> None:
        block.hits += 1
        block.freq = min(block.freq + 1, 3)

    def _push(self, block: KVCacheBlock, where: int) -> None:
        tick = self._stamp(block)
        block.where = where
        if where == 1:
            self.small.append((tick, block))
            self.n_small += 1
        else:
            self.main.append((tick, block))
            self.n_main += 1

    def _insert(self, block: KVCacheBlock) -> None:
        if block.block_hash in self.ghost:
            del self.ghost[block.block_hash]
            self._push(block, 2)
        else:
            self._push(block, 1)

    def _discard(self, block: KVCacheBlock) -> None:
        if block.where == 1:
            self.n_small -= 1
        else:
            self.n_main -= 1
        block.where = 0

    def _pop_live(self, q: deque) -> KVCacheBlock:
        while True:
            tick, block = q.popleft()
            if block.tick == tick:
                return block

    def _victim(self) -> KVCacheBlock:
        while True:
            if self.n_small > self.small_fraction * self.num_cached or self.n_main == 0:
                block = self._pop_live(self.small)
                self.n_small -= 1
                if block.freq > 0:
                    block.freq = 0
                    self._push(block, 2)
                    continue
                self.ghost[block.block_hash] = None
                if len(self.ghost) > max(self.num_cached, 1):
                    self.ghost.popitem(last=False)
            else:
                block = self._pop_live(self.main)
                self.n_main -= 1
                if block.freq > 0:
                    block.freq -= 1
                    self._push(block, 2)
                    continue
            block.where = 0
            block.freq = 0
            return block


class PinnedLRU(LRU):
    """LRU that never evicts pinned prefixes, up to `max_pinned` blocks.

    A block is pinned when its key was pinned explicitly (`pin`) or, with
    `pin_after` > 0, once it has been hit that many times. An unreferenced
    pinned block stays cached outside the free queue, so it is not free.
    """

    name = "pinned"

    def __init__(self, max_pinned: int = 1024, pin_after: int = 2) -> None:
        super().__init__()
        self.max_pinned = max_pinned
        self.pin_after = pin_after
        self.keys: set[int] = set()
        self.num_pinned = 0

    def pin_keys(self, keys: list[int]) -> None:
        self.keys.update(keys)

    def _maybe_pin(self, block: KVCacheBlock) -> None:
        if not block.pinned and self.num_pinned < self.max_pinned:
            block.pinned = True
            self.num_pinned += 1

    def on_cache(self, block: KVCacheBlock) -> None:
        if block.block_hash in self.keys:
            self._maybe_pin(block)

    def on_hit(self, block: KVCacheBlock) -> None:
        block.hits += 1
        if self.pin_after and block.hits >= self.pin_after:
            self._maybe_pin(block)

    def free(self, blocks: list[KVCacheBlock]) -> None:
        self.queue.append_n([b for b in blocks if not b.pinned])

    def remove(self, block: KVCacheBlock) -> None:
        if not block.pinned:
            self.queue.remove(block)


POLICIES: dict[str, type[EvictionPolicy]] = {
    p.name: p for p in (LRU, LFU, FIFO, S3FIFO, CostAware, PinnedLRU)
}


def make_policy(name: str, block_size: int = 16) -> EvictionPolicy:
    """Build a policy by name; unknown names get a clear error."""
    if name not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; choose from {', '.join(POLICIES)}")
    if name == "cost":
        return CostAware(block_size)
    return POLICIES[name]()
