"""The free-block queue: a doubly linked list with O(1) pop-front, append and remove.

Its order is the LRU eviction order: blocks are reused from the front, freed
cached blocks join at the back (uncached ones at the front, from vLLM 0.24),
and a cache hit on a free block unlinks it in O(1).

    sentinel_head <-> b1 <-> b2 <-> ... <-> bn <-> sentinel_tail
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import islice

from kvsim.kvcache.block import KVCacheBlock


class FreeBlockQueue:
    """Intrusive doubly linked list over `KVCacheBlock.prev/next`."""

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()):
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next = self._tail
        self._tail.prev = self._head
        self.num_free_blocks = 0
        self.append_n(list(blocks))

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        block = self._head.next
        if block is self._tail:
            raise ValueError("no free blocks")
        nxt = block.next
        self._head.next = nxt
        nxt.prev = self._head
        block.prev = block.next = None
        self.num_free_blocks -= 1
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, only {self.num_free_blocks} free")
        out = []
        block = self._head.next
        for _ in range(n):
            out.append(block)
            nxt = block.next
            block.prev = block.next = None
            block = nxt
        self._head.next = block
        block.prev = self._head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev, block.next
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next = nxt
        nxt.prev = prev
        block.prev = block.next = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev
        last.next = block
        block.prev = last
        block.next = self._tail
        self._tail.prev = block
        self.num_free_blocks += 1

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        if blocks:
            self.splice_back(*_chain(blocks), len(blocks))

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        """Put `blocks` at the front, in their given order (the first is reused first)."""
        if blocks:
            self.splice_front(*_chain(blocks), len(blocks))

    def front(self) -> KVCacheBlock:
        """The first block (the tail sentinel when the queue is empty)."""
        return self._head.next

    def detach_front(self, rest: KVCacheBlock, n: int) -> None:
        """The caller took the `n` blocks before `rest` (walking `next` from `front()`, clearing their
        links as it went): `rest` is the front now."""
        self._head.next = rest
        rest.prev = self._head
        self.num_free_blocks -= n

    def splice_front(self, first: KVCacheBlock, last: KVCacheBlock, n: int) -> None:
        """Put the `n` blocks linked from `first` to `last` at the front, in their order."""
        head = self._head
        old = head.next
        first.prev = head
        head.next = first
        last.next = old
        old.prev = last
        self.num_free_blocks += n

    def splice_back(self, first: KVCacheBlock, last: KVCacheBlock, n: int) -> None:
        """Put the `n` blocks linked from `first` to `last` at the back, in their order."""
        tail = self._tail
        old = tail.prev
        first.prev = old
        old.next = first
        last.next = tail
        tail.prev = last
        self.num_free_blocks += n

    def __iter__(self):
        block = self._head.next
        while block is not self._tail:
            yield block
            block = block.next

    def block_ids(self) -> list[int]:
        return [b.block_id for b in self]


def _chain(blocks: list[KVCacheBlock]) -> tuple[KVCacheBlock, KVCacheBlock]:
    """Link `blocks` in their order (each `next` the following one); returns the first and the last."""
    prev = blocks[0]
    for block in islice(blocks, 1, None):
        prev.next = block
        block.prev = prev
        prev = block
    return blocks[0], prev
