"""The used block-id span without remapping: what id-space fragmentation needs when no defragmenter runs."""

from __future__ import annotations

from kvsim.kvcache.block import KVCacheBlock


class IdSpan:
    """Counts used blocks and bounds the highest used id; the pool reports every 0 <-> 1 reference change.

    A cheap stand-in for `Defragmenter` as the pool's tracker when ids are never
    moved: the pool calls it on every allocation and free, so it keeps plain ints.
    """

    def __init__(self, blocks: list[KVCacheBlock]):
        self.blocks = blocks
        self._num_used = 0
        self._max_used = 0  # an upper bound, exact unless `_max_stale`
        self._max_stale = False

    def use_distinct(self, ids: list[int]) -> None:
        self._num_used += len(ids)
        top = ids[0] if len(ids) == 1 else max(ids)
        if top > self._max_used:
            self._max_used = top

    def release_distinct(self, ids: list[int]) -> None:
        self._num_used -= len(ids)
        if not self._max_stale and self._max_used in ids:
            self._max_stale = True

    def use(self, n: int, top: int) -> None:
        """`use_distinct` of `n` ids whose highest is `top` (all the pool's take loops work out)."""
        self._num_used += n
        if top > self._max_used:
            self._max_used = top

    def release(self, n: int, among: list[KVCacheBlock]) -> None:
        """`release_distinct` of `n` blocks whose ref counts just reached 0, all in `among`.

        NOTE: the top block was released here iff it is in `among` with ref count 0 (one released
        before this call would have been a double free), so no id list is needed.
        """
        self._num_used -= n
        if not self._max_stale and self._max_used:
            top = self.blocks[self._max_used]
            if not top.ref_cnt and top in among:
                self._max_stale = True

    def num_used(self) -> int:
        return self._num_used

    def max_used(self) -> int:
        """Highest used id; 0 when nothing is used."""
        if self._max_stale:
            top, blocks = self._max_used, self.blocks
            while top and not blocks[top].ref_cnt:
                top -= 1
            self._max_used, self._max_stale = top, False
        return self._max_used

    def fragmentation(self) -> int:
        """Holes below the highest used id (id 0 excluded); 0 when nothing is used."""
        return self.max_used() - self._num_used if self._num_used else 0
