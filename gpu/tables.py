"""Every sequence's block table as the op stream builds it (the replayer's view of the manager)."""

from __future__ import annotations

from collections import defaultdict

import numpy as np


class BlockTables:
    """Rows of physical block ids per sequence: `table` ops set entries (0: null block,
    -1: never set), a `move` exchanges two ids in every row, and a `free` of a block
    releases every sequence still holding it (its whole row goes)."""

    def __init__(self) -> None:
        self.rows: dict[str, list[int]] = {}
        self.holders: defaultdict[int, set[str]] = defaultdict(set)
        self._where: dict[str, dict[int, list[int]]] = {}  # seq -> block -> its entries in the row

    def set(self, seq: str, index: int, block: int) -> None:
        """Entry `index` of `seq`'s row is now physical `block`."""
        row = self.rows.setdefault(seq, [])
        where = self._where.setdefault(seq, {})
        if index >= len(row):
            row.extend([-1] * (index + 1 - len(row)))
        old = row[index]
        if old > 0:
            entries = where[old]
            entries.remove(index)
            if not entries:
                del where[old]
                self.holders[old].discard(seq)
        row[index] = block
        if block > 0:
            where.setdefault(block, []).append(index)
            self.holders[block].add(seq)

    def release(self, seq: str) -> None:
        """Forget `seq`'s row (it was freed, preempted or swapped out)."""
        self.rows.pop(seq, None)
        for b in self._where.pop(seq, ()):
            self.holders[b].discard(seq)

    def free(self, block: int) -> list[str]:
        """A free of `block` (ref count 0): every sequence still holding it is gone; returns them."""
        seqs = sorted(self.holders.pop(block, ()))
        for s in seqs:
            self.release(s)
        return seqs

    def exchange(self, a: int, b: int) -> None:
        """A defrag move: ids `a` and `b` trade places in every row (cost: the entries they hold)."""
        ha, hb = self.holders.pop(a, set()), self.holders.pop(b, set())
        for s in ha | hb:
            row, where = self.rows[s], self._where[s]
            at_a, at_b = where.pop(a, None), where.pop(b, None)
            if at_a:
                for i in at_a:
                    row[i] = b
                where[b] = at_a
            if at_b:
                for i in at_b:
                    row[i] = a
                where[a] = at_b
        if ha:
            self.holders[b] = ha
        if hb:
            self.holders[a] = hb

    def entries(self, block: int) -> list[tuple[str, list[int]]]:
        """(sequence, its entries naming `block`) for every sequence holding `block`."""
        return [(s, self._where[s][block]) for s in self.holders.get(block, ())]

    def first_unset(self, seq: str, extent: int, block_size: int) -> int:
        """The first position below `extent` whose entry was never set (-1 if none)."""
        row, pages = self.rows.get(seq, ()), -(-extent // block_size)
        if len(row) >= pages and (not pages or min(row[:pages]) >= 0):
            return -1
        i = next((i for i, b in enumerate(row[:pages]) if b < 0), min(len(row), pages))
        return i * block_size

    def slots(self, seq: str, extent: int, block_size: int) -> tuple[np.ndarray, np.ndarray, int]:
        """Positions [0, extent) of `seq` outside null entries, their physical blocks, and the
        first position whose entry was never set (-1 if none)."""
        pages = -(-extent // block_size)
        row = np.asarray(self.rows.get(seq, ())[:pages], dtype=np.int64)
        if len(row) < pages:
            row = np.concatenate([row, np.full(pages - len(row), -1, dtype=np.int64)])
        missing = self.first_unset(seq, extent, block_size)
        pos = np.arange(extent, dtype=np.int64)
        blocks = row[pos // block_size]
        keep = blocks > 0
        return pos[keep], blocks[keep], missing
