"""ARC, the Adaptive Replacement Cache (Megiddo & Modha, FAST'03), over the free cached blocks."""

from __future__ import annotations

from collections import OrderedDict

from kvsim.kvcache.block import KVCacheBlock
from kvsim.kvcache.eviction.base import CachedPolicy


class ARC(CachedPolicy):
    """Recency list T1 (blocks seen once), frequency list T2 (hit since cached), ghosts B1/B2.

    A cached block starts in T1 and moves to T2 on its first prefix-cache hit; a
    block whose key is a ghost is cached straight into T2 and moves the target
    size `p` of T1: up by max(1, |B2|/|B1|) for a B1 ghost, down by
    max(1, |B1|/|B2|) for a B2 ghost. The victim is T1's least recently freed
    block while |T1| > p (or T2 has no free block), else T2's; its key joins B1 or
    B2. |T1| and |T2| count every cached block, referenced or not (as in vLLM's
    offloading ARC); only free ones are in the `t1`/`t2` eviction orders.
    Directory bounds as in the paper: |T1| + |B1| <= c, |T1|+|T2|+|B1|+|B2| <= 2c.
    """

    name = "arc"

    def __init__(self) -> None:
        super().__init__()
        self.p = 0.0  # target |T1|
        self.capacity = 0  # c: usable blocks
        self.t1: OrderedDict[int, KVCacheBlock] = OrderedDict()  # free T1 blocks by id, LRU first
        self.t2: OrderedDict[int, KVCacheBlock] = OrderedDict()
        self.b1: OrderedDict[int, None] = OrderedDict()  # ghost keys, oldest first
        self.b2: OrderedDict[int, None] = OrderedDict()
        self.n1 = 0  # |T1|: cached blocks seen once
        self.n2 = 0  # |T2|
        self.level = bytearray()  # per block id: 1 in T1, 2 in T2, 0 not cached

    def bind(self, num_blocks: int) -> None:
        super().bind(num_blocks)
        self.capacity = num_blocks - 1
        self.level = bytearray(num_blocks)

    def on_cache(self, block: KVCacheBlock, depth: int, chain: int) -> None:
        key = block.block_hash
        if key in self.b1:
            self.p = min(self.p + max(1.0, len(self.b2) / len(self.b1)), self.capacity)
            del self.b1[key]
        elif key in self.b2:
            self.p = max(self.p - max(1.0, len(self.b1) / len(self.b2)), 0.0)
            del self.b2[key]
        else:
            self.level[block.block_id] = 1
            self.n1 += 1
            self._trim_ghosts()
            return
        self.level[block.block_id] = 2
        self.n2 += 1

    def on_hit(self, block: KVCacheBlock) -> None:
        # NOTE: the pool takes a free block out (`remove`) before reporting its hit,
        # so a block moves between levels only while it is in neither t1 nor t2.
        if self.level[block.block_id] == 1:
            self.level[block.block_id] = 2
            self.n1 -= 1
            self.n2 += 1

    def _trim_ghosts(self) -> None:
        c = self.capacity
        while self.b1 and self.n1 + len(self.b1) > c:
            self.b1.popitem(last=False)
        while self.b2 and self.n1 + self.n2 + len(self.b1) + len(self.b2) > 2 * c:
            self.b2.popitem(last=False)

    def _insert(self, block: KVCacheBlock) -> None:
        self._stamp(block)
        (self.t1 if self.level[block.block_id] == 1 else self.t2)[block.block_id] = block

    def _discard(self, block: KVCacheBlock) -> None:
        del (self.t1 if self.level[block.block_id] == 1 else self.t2)[block.block_id]

    def _victim(self) -> KVCacheBlock:
        if self.t1 and (self.n1 > self.p or not self.t2):
            _, block = self.t1.popitem(last=False)
            self.n1 -= 1
            ghosts = self.b1
        else:
            _, block = self.t2.popitem(last=False)
            self.n2 -= 1
            ghosts = self.b2
        key = block.block_hash
        self.b1.pop(key, None)  # a key another block still held may already be a ghost
        self.b2.pop(key, None)
        ghosts[key] = None
        self.level[block.block_id] = 0
        return block
