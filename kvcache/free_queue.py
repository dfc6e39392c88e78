"""The free-block queue: O(1) pop-front, append and remove, in vLLM V1's order.

Its order is the LRU eviction order: blocks are reused from the front, freed
cached blocks join at the back (uncached ones at the front, from vLLM 0.24),
and a cache hit on a free block unlinks it in O(1).

The queue is two parts, the front one first:

    front stack [bk ... b2 b1]  (a Python list; its last item is the queue's first block)
    sentinel_head <-> c1 <-> c2 <-> ... <-> cn <-> sentinel_tail  (intrusive links)

Blocks put at the front (`prepend_n`, and the blocks the queue starts with) go
on the stack, so a run of them is pushed and popped by list slicing, not block
by block: a sliding window's prefill chunk takes and gives back hundreds of
blocks a step, and the pool's per-block Python work was what made a hybrid
model slow. A stacked block has no links (`prev` is None); `remove` finds it in
the stack (a linear search: the pool only removes cache hits, which it never
puts at the front). The order is exactly that of one linked list.

Below the front stack may lie fresh blocks (`start_fresh`): a new pool's blocks that were never
handed out, ids ascending from the lowest, made only when first needed (`unfresh` puts them at
the stack's bottom, where they were). A replica of a large model holds tens of thousands of
blocks, most of which a short or lightly loaded run never touches; making each one as an object,
and having the cyclic collector scan them all, was a fifth of a 16-replica cluster's short run.
The queue's order, its length and every block handed out are those of making them all at once.
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
        self.stack: list[KVCacheBlock] = list(blocks)[::-1]  # the front part, its last item first
        self.num_free_blocks = len(self.stack)
        self.num_fresh = 0  # blocks not made yet, below the stack (counted in num_free_blocks)
        self._made: list[KVCacheBlock] = []  # the pool's blocks by id, which making a fresh one extends

    def start_fresh(self, made: list[KVCacheBlock], n: int) -> None:
        """Put `n` blocks not made yet below the front stack: ids len(made) to len(made) + n - 1, the
        lowest first in the queue; each is made, appended to `made`, when first needed."""
        if self.num_fresh:
            raise ValueError("the free queue already has fresh blocks")
        self._made = made
        self.num_fresh = n
        self.num_free_blocks += n

    def unfresh(self, n: int) -> int:
        """Make up to `n` fresh blocks and put them at the stack's bottom, where they were (the
        lowest id nearest the top); returns how many were made."""
        k = n if n < self.num_fresh else self.num_fresh
        made = self._made
        start = len(made)
        new = [KVCacheBlock(i) for i in range(start + k - 1, start - 1, -1)]
        made += new[::-1]
        self.stack[:0] = new
        self.num_fresh -= k
        return k

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        if self.stack or (self.num_fresh and self.unfresh(1)):
            self.num_free_blocks -= 1
            return self.stack.pop()
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
        out = self.pop_stack(n)
        rest = n - len(out)
        if rest:
            block = self._head.next
            for _ in range(rest):
                out.append(block)
                nxt = block.next
                block.prev = block.next = None
                block = nxt
            self.detach_front(block, rest)
        return out

    def pop_stack(self, n: int) -> list[KVCacheBlock]:
        """Up to `n` blocks off the front stack, the queue's first first (whole slices, no links)."""
        stack = self.stack
        if n > len(stack) and self.num_fresh:
            self.unfresh(n - len(stack))
        k = len(stack) - n if n < len(stack) else 0
        out = stack[k:]
        del stack[k:]
        out.reverse()
        self.num_free_blocks -= len(out)
        return out

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev, block.next
        if prev is None or nxt is None:
            try:
                self.stack.remove(block)
            except ValueError:
                raise ValueError(f"block {block.block_id} is not in the free queue") from None
            self.num_free_blocks -= 1
            return
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
        self.push_front_reversed(blocks[::-1])

    def push_front_reversed(self, blocks: list[KVCacheBlock]) -> None:
        """Put `blocks` at the front, the last of them first (`prepend_n` of them reversed): onto the
        stack in one extend."""
        self.stack += blocks
        self.num_free_blocks += len(blocks)

    def front(self) -> KVCacheBlock:
        """The first block of the linked part (the tail sentinel when it is empty): the queue's first
        once the stack is empty and no fresh block is left."""
        return self._head.next

    def detach_front(self, rest: KVCacheBlock, n: int) -> None:
        """The caller took the `n` linked blocks before `rest` (walking `next` from `front()` once the
        stack was empty, clearing their links as it went): `rest` is the linked part's front now."""
        self._head.next = rest
        rest.prev = self._head
        self.num_free_blocks -= n

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
        """The free blocks in queue order; fresh ones are made as the walk reaches them (in runs
        doubling in length, so a walk of the first few makes few)."""
        yield from reversed(self.stack)
        run = 1
        while self.num_fresh:
            k = self.unfresh(run)
            yield from reversed(self.stack[:k])
            run *= 2
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
