"""ARC over the host tier's chunks, as vLLM 0.33's `ARCCachePolicy` (vllm/v1/kv_offload/cpu/policies/arc.py).

T1 holds chunks not yet reused, T2 chunks reused since they were stored, B1 and
B2 the keys lately evicted from each. A new chunk always enters T1; it moves to
T2 only when a request that reused it (loaded it, or offered it while ready)
finishes. A store miss on a ghost key moves the target size of T1. This is
vLLM's variant, not the paper's: see `evict` for the ghost bound.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence


class HostARC:
    """T1, T2 (resident, LRU first), ghosts B1, B2 (oldest first), and the float target |T1|."""

    name = "arc"
    hooks_store_misses = True  # a store miss on a ghost moves the target (`on_store_miss`)

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.target_t1 = 0.0
        self.t1: OrderedDict[int, None] = OrderedDict()  # |T1| counts pending and pinned chunks too
        self.t2: OrderedDict[int, None] = OrderedDict()
        self.b1: OrderedDict[int, None] = OrderedDict()
        self.b2: OrderedDict[int, None] = OrderedDict()
        self._evictable: set[int] = set()  # ref count 0

    def insert(self, keys: Sequence[int], req: str, positions: Sequence[int]) -> None:
        """New chunks go to T1's MRU end, in order, and stop being ghosts."""
        t1, b1, b2 = self.t1, self.b1, self.b2
        for key in keys:
            t1[key] = None
            b1.pop(key, None)
            b2.pop(key, None)

    def remove(self, key: int) -> None:
        """A failed store's chunk leaves the tier (and leaves no ghost)."""
        if key in self.t1:
            del self.t1[key]
        else:
            self.t2.pop(key, None)
        self._evictable.discard(key)

    def mark_evictable(self, keys: Sequence[int]) -> None:
        """Ref counts reached 0."""
        self._evictable.update(keys)

    def mark_non_evictable(self, key: int) -> None:
        self._evictable.remove(key)

    def on_store_miss(self, keys: Sequence[int]) -> None:
        """New store candidates, tail first: a B1 ghost raises the target by max(1, |B2|/|B1|)
        (at most the capacity), a B2 ghost lowers it by max(1, |B1|/|B2|) (at least 0)."""
        for key in reversed(keys):
            if key in self.b1:
                self.target_t1 = min(self.target_t1 + max(1, len(self.b2) / len(self.b1)), self.capacity)
                self.b1.move_to_end(key)
            elif key in self.b2:
                self.target_t1 = max(self.target_t1 - max(1, len(self.b1) / len(self.b2)), 0)
                self.b2.move_to_end(key)

    def on_request_access(self, req: str, keys: Sequence[int], positions: Sequence[int]) -> None:
        """Nothing: ARC learns only when the request finishes."""

    def on_request_finished(self, req: str, keys: Sequence[int], insertion_only: set[int],
                            reused: set[int]) -> None:
        """Commit, tail first over `keys` (head to tail): a reused key moves to T2's MRU end, a key
        the request only inserted to its own list's MRU end; any other key stays put."""
        # NOTE: membership only, as vLLM: a reused key since evicted and stored again by
        # another request (pending, in T1) is promoted too.
        for key in reversed(keys):
            if key in insertion_only:
                if key in self.t1:
                    self.t1.move_to_end(key)
                elif key in self.t2:
                    self.t2.move_to_end(key)
            elif key in reused:
                if key in self.t1:
                    del self.t1[key]
                    self.t2[key] = None
                elif key in self.t2:
                    self.t2.move_to_end(key)

    def _next(self, keys: Iterator[int], protected: set[int]) -> int | None:
        for key in keys:
            if key in self._evictable and key not in protected:
                return key
        return None

    def evict(self, n: int, protected: set[int]) -> list[int] | None:
        """`n` victims, or None with nothing changed. Each comes from T1 while the T1 left after
        the victims so far is at least int(target), else from T2, else from T1."""
        if n == 0:
            return []
        t1_left = len(self.t1)
        t1_keys, t2_keys = iter(self.t1), iter(self.t2)
        picked: list[tuple[int, bool]] = []  # (key, from T1)
        for _ in range(n):
            key = self._next(t1_keys, protected) if t1_left >= int(self.target_t1) else None
            from_t1 = key is not None
            if key is None:
                key = self._next(t2_keys, protected)
            if key is None:
                key = self._next(t1_keys, protected)
                if key is None:
                    return None
                from_t1 = True
            t1_left -= from_t1
            picked.append((key, from_t1))
        for key, from_t1 in picked:
            self._evictable.remove(key)
            if from_t1:
                del self.t1[key]
                self.b1[key] = None
            else:
                del self.t2[key]
                self.b2[key] = None
        # NOTE: vLLM (ARCCachePolicy.evict) trims each ghost list to the capacity on
        # its own, after a successful eviction only; not the paper's |T1| + |B1| <= c
        # and |T1| + |T2| + |B1| + |B2| <= 2c.
        for ghosts in (self.b1, self.b2):
            for _ in range(len(ghosts) - self.capacity):
                ghosts.popitem(last=False)
        return [key for key, _ in picked]

    def clear(self) -> None:
        """Forget every chunk, ghost and the target."""
        for keys in (self.t1, self.t2, self.b1, self.b2, self._evictable):
            keys.clear()
        self.target_t1 = 0.0
