"""Online defragmentation of the block-id space (the Gaudi `OnlineDefragmenter` semantics).

The allocator keeps handing out its own ids; this class maps them to *physical*
ids and, when the highest used physical id runs more than `threshold` past the
number of used blocks, exchanges the highest used blocks with the lowest holes.

    fwd_mapping[allocator id] -> physical id      bwd_mapping[physical id] -> allocator id

Id 0 is the reserved null block: never used, never moved. Ref counts are kept
per physical id, so an exchange swaps the counts and both mappings.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

PAD_BUCKETS = (8, 16, 32, 64, 128, 256, 512)


class Defragmenter:
    """Tracks used physical block ids and plans exchange moves that compact them."""

    def __init__(self, num_blocks: int, threshold: int = 32, pad_buckets: Sequence[int] = PAD_BUCKETS):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if threshold < 0:
            raise ValueError(f"threshold must be >= 0, got {threshold}")
        buckets = tuple(int(b) for b in pad_buckets)
        if not buckets or buckets[0] < 1 or any(a >= b for a, b in zip(buckets, buckets[1:], strict=False)):
            raise ValueError(f"pad_buckets must be positive and strictly ascending, got {pad_buckets}")
        self.num_blocks = num_blocks
        self.threshold = threshold
        self.pad_buckets = buckets
        self.ref_counts = np.zeros(num_blocks, dtype=np.int64)  # by physical id
        self.fwd_mapping = np.arange(num_blocks, dtype=np.int64)
        self.bwd_mapping = np.arange(num_blocks, dtype=np.int64)
        self.num_moves = 0
        self.num_defrags = 0
        self._num_used = 0
        # NOTE: `_max_used` is exact unless `_max_stale`; then it is an upper bound,
        # tightened only when a query needs it (releases of the top id are common).
        self._max_used = 0
        self._max_stale = False

    # -- id mapping ----------------------------------------------------------

    def resolve(self, ids: int | np.ndarray) -> int | np.ndarray:
        """Allocator id(s) -> physical id(s)."""
        return self._lookup(self.fwd_mapping, ids, "allocator")

    def unresolve(self, ids: int | np.ndarray) -> int | np.ndarray:
        """Physical id(s) -> allocator id(s)."""
        return self._lookup(self.bwd_mapping, ids, "physical")

    # -- usage ---------------------------------------------------------------

    def use(self, block: int) -> None:
        """Add a reference to allocator id `block`."""
        self.use_many(np.array([block]))

    def release(self, block: int) -> None:
        """Drop a reference to allocator id `block`."""
        self.release_many(np.array([block]))

    def use_many(self, ids: Iterable[int] | np.ndarray) -> None:
        """Add one reference per entry of `ids` (allocator ids; repeats count twice)."""
        phys, counts = self._physical_counts(ids)
        if phys.size == 0:
            return
        self._num_used += int(np.count_nonzero(self.ref_counts[phys] == 0))
        self.ref_counts[phys] += counts
        if phys[-1] > self._max_used:
            self._max_used = int(phys[-1])

    def release_many(self, ids: Iterable[int] | np.ndarray) -> None:
        """Drop one reference per entry of `ids` (allocator ids)."""
        phys, counts = self._physical_counts(ids)
        if phys.size == 0:
            return
        short = np.flatnonzero(self.ref_counts[phys] < counts)
        if short.size:
            p = int(phys[short[0]])
            raise ValueError(
                f"release of block {int(self.bwd_mapping[p])} (physical {p}) "
                f"with ref count {int(self.ref_counts[p])}"
            )
        self.ref_counts[phys] -= counts
        freed = phys[self.ref_counts[phys] == 0]
        self._num_used -= freed.size
        if freed.size and freed[-1] == self._max_used:
            self._max_stale = True

    # NOTE: the pool's fast paths below take distinct, valid allocator ids and skip
    # the checks above; they are called on every allocation and free.
    def use_distinct(self, ids: list[int]) -> None:
        """Block-pool fast path: each id in `ids` (distinct) gains one reference."""
        if len(ids) > 16:
            phys = self.fwd_mapping[ids]
            rc = self.ref_counts
            self._num_used += len(ids) - int(np.count_nonzero(rc[phys]))
            rc[phys] += 1
            top = int(phys.max())
        else:
            fwd, rc, top = self.fwd_mapping, self.ref_counts, 0
            for b in ids:
                p = int(fwd[b])
                if rc[p] == 0:
                    self._num_used += 1
                rc[p] += 1
                if p > top:
                    top = p
        if top > self._max_used:
            self._max_used = top

    def release_distinct(self, ids: list[int]) -> None:
        """Block-pool fast path: each id in `ids` (distinct, referenced) drops one reference."""
        phys = self.fwd_mapping[ids]
        rc = self.ref_counts
        rc[phys] -= 1
        freed = int(np.count_nonzero(rc[phys] == 0))
        self._num_used -= freed
        if freed and self._max_used in phys:
            self._max_stale = True

    def ref_count(self, block: int) -> int:
        """References held on allocator id `block`."""
        return int(self.ref_counts[self.resolve(block)])

    def num_used(self) -> int:
        """Number of physical ids with a reference."""
        return self._num_used

    def max_used(self) -> int:
        """Highest used physical id; 0 when nothing is used."""
        if self._max_stale:
            self._max_used = self._scan_down(self._max_used)
            self._max_stale = False
        return self._max_used

    def fragmentation(self) -> int:
        """Holes below the highest used physical id (id 0 excluded); 0 when nothing is used."""
        return self.max_used() - self._num_used if self._num_used else 0

    # -- defragmentation -----------------------------------------------------

    def due(self) -> bool:
        """True if `defragment` would move blocks now (fragmentation > threshold)."""
        # The upper bound settles the common case without touching the arrays.
        if self._num_used == 0 or self._max_used - self.threshold <= self._num_used:
            return False
        return self.max_used() - self.threshold > self._num_used

    def defragment(self) -> list[tuple[int, int]]:
        """Exchange the highest used ids with the lowest holes if fragmentation > threshold.

        Returns the (src, dst) physical pairs, at most `pad_buckets[-1]`; each is a
        content exchange (src's data goes to dst and dst's to src).
        """
        if not self.due():
            return []
        top = self.max_used()
        used = np.flatnonzero(self.ref_counts[: top + 1])
        cap = self.pad_buckets[-1]
        free = np.flatnonzero(self.ref_counts[1 : top + 1] == 0)[:cap] + 1
        highest = used[::-1][: free.size]
        # `highest` descends and `free` ascends, so pairs with free < used form a prefix.
        n = int(np.count_nonzero(free[: highest.size] < highest))
        srcs, dsts = highest[:n], free[:n]
        self._exchange(srcs, dsts)
        rest_top = int(used[used.size - n - 1]) if used.size > n else 0
        self._max_used = max(rest_top, int(dsts[-1]) if n else 0)
        self._max_stale = False
        self.num_moves += n
        self.num_defrags += 1
        return list(zip(srcs.tolist(), dsts.tolist(), strict=True))

    def padded_size(self, n: int) -> int:
        """The smallest pad bucket >= n (or the largest), the batch size a GPU swap runs at."""
        return next((b for b in self.pad_buckets if b >= n), self.pad_buckets[-1])

    # -- internals -----------------------------------------------------------

    def _exchange(self, srcs: np.ndarray, dsts: np.ndarray) -> None:
        """Swap ref counts and both mappings for disjoint physical pairs (src used, dst free)."""
        alloc_src = self.bwd_mapping[srcs]
        alloc_dst = self.bwd_mapping[dsts]
        self.fwd_mapping[alloc_src] = dsts
        self.fwd_mapping[alloc_dst] = srcs
        self.bwd_mapping[dsts] = alloc_src
        self.bwd_mapping[srcs] = alloc_dst
        self.ref_counts[srcs], self.ref_counts[dsts] = self.ref_counts[dsts], self.ref_counts[srcs]

    def _scan_down(self, bound: int) -> int:
        """Highest used physical id <= bound, scanning down in doubling windows."""
        hi, window = bound + 1, 1024
        while hi > 0:
            lo = max(0, hi - window)
            nz = np.flatnonzero(self.ref_counts[lo:hi])
            if nz.size:
                return lo + int(nz[-1])
            hi, window = lo, window * 2
        return 0

    def _physical_counts(self, ids: Iterable[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Sorted distinct physical ids of allocator `ids`, with multiplicities."""
        arr = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids), dtype=np.int64).reshape(-1)
        if arr.size and (arr.min() < 1 or arr.max() >= self.num_blocks):
            bad = int(arr[(arr < 1) | (arr >= self.num_blocks)][0])
            raise ValueError(f"block id {bad} not in [1, num_blocks {self.num_blocks})")
        return np.unique(self.fwd_mapping[arr], return_counts=True)

    def _lookup(self, table: np.ndarray, ids: int | np.ndarray, kind: str) -> int | np.ndarray:
        arr = np.asarray(ids)
        if arr.size and (arr.min() < 0 or arr.max() >= self.num_blocks):
            bad = int(arr[(arr < 0) | (arr >= self.num_blocks)].flat[0])
            raise ValueError(f"{kind} id {bad} not in [0, num_blocks {self.num_blocks})")
        out = table[arr]
        return int(out) if arr.ndim == 0 else out


def exchange_permutation(moves: Iterable[tuple[int, int]], num_blocks: int) -> np.ndarray:
    """Old physical id -> new physical id after `moves` (for `BlockTable.remap` on physical rows)."""
    perm = np.arange(num_blocks, dtype=np.int64)
    for src, dst in moves:
        perm[src], perm[dst] = perm[dst], perm[src]
    return perm
