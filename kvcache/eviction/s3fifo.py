"""S3-FIFO (Yang et al., SOSP'23): a small probationary FIFO, a main FIFO and a ghost list."""

from __future__ import annotations

from collections import OrderedDict, deque

from kvsim.kvcache.block import KVCacheBlock
from kvsim.kvcache.eviction.base import CachedPolicy

SMALL, MAIN = 1, 2  # `where` a free cached block is queued; 0: in neither


class S3FIFO(CachedPolicy):
    """S3-FIFO over the free cached blocks.

    New cached blocks enter the small queue (or main, if their key is a ghost);
    a block hit while queued is promoted from small to main, and gets another
    lap in main; blocks evicted from small leave their key in the ghost list.
    """

    name = "s3fifo"

    def __init__(self, small_fraction: float = 0.1) -> None:
        super().__init__()
        self.small_fraction = small_fraction
        self.small: deque = deque()  # (tick, block), stale entries skipped
        self.main: deque = deque()
        self.n_small = 0
        self.n_main = 0
        self.ghost: OrderedDict[int, None] = OrderedDict()
        self.freq: list[int] = []  # access counter, capped at 3
        self.where: list[int] = []  # SMALL, MAIN or 0

    def bind(self, num_blocks: int) -> None:
        super().bind(num_blocks)
        self.freq = [0] * num_blocks
        self.where = [0] * num_blocks

    def on_hit(self, block: KVCacheBlock) -> None:
        i = block.block_id
        self.freq[i] = min(self.freq[i] + 1, 3)

    def _push(self, block: KVCacheBlock, where: int) -> None:
        tick = self._stamp(block)
        self.where[block.block_id] = where
        if where == SMALL:
            self.small.append((tick, block))
            self.n_small += 1
        else:
            self.main.append((tick, block))
            self.n_main += 1

    def _insert(self, block: KVCacheBlock) -> None:
        if block.block_hash in self.ghost:
            del self.ghost[block.block_hash]
            self._push(block, MAIN)
        else:
            self._push(block, SMALL)

    def _discard(self, block: KVCacheBlock) -> None:
        if self.where[block.block_id] == SMALL:
            self.n_small -= 1
        else:
            self.n_main -= 1
        self.where[block.block_id] = 0

    def _pop_live(self, q: deque) -> KVCacheBlock:
        live = self.tick
        while True:
            tick, block = q.popleft()
            if live[block.block_id] == tick:
                return block

    def _victim(self) -> KVCacheBlock:
        freq = self.freq
        while True:
            if self.n_small > self.small_fraction * self.num_cached or self.n_main == 0:
                block = self._pop_live(self.small)
                self.n_small -= 1
                if freq[block.block_id] > 0:
                    freq[block.block_id] = 0
                    self._push(block, MAIN)
                    continue
                self.ghost[block.block_hash] = None
                if len(self.ghost) > max(self.num_cached, 1):
                    self.ghost.popitem(last=False)
            else:
                block = self._pop_live(self.main)
                self.n_main -= 1
                if freq[block.block_id] > 0:
                    freq[block.block_id] -= 1
                    self._push(block, MAIN)
                    continue
            self.where[block.block_id] = 0
            freq[block.block_id] = 0
            return block
