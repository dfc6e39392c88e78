"""LRU over the host tier's chunks, as vLLM 0.33's `LRUCachePolicy` (vllm/v1/kv_offload/cpu/policies/lru.py).

Every resident chunk has a rank, a pair; the victim is the smallest rank among
the evictable (ready, unpinned) chunks that the current offer does not protect.
While a request runs, the chunks it stores or first sees share its request rank,
tail first: `(request_rank, -position)`. When it finishes, every chunk it saw
that is still resident gets a fresh rank, tail first, so its head is the most
recently used. Request ranks and fresh ranks come from one counter.

A rank is kept as one int, `counter << 40 | (2**39 - position)`: the pairs' order (positions stay far
below 2**39), so the heap compares ints, not pairs of them.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

Rank = int  # (counter, -position) as one int: see the module docstring
_TAIL = 1 << 39  # the rank of position p under a counter c is c << 40 | (_TAIL - p)


def _rank(counter: int, position: int) -> Rank:
    """The rank of `(counter, -position)`, order kept."""
    return (counter << 40) | (_TAIL - position)


class HostLRU:
    """Ranks in a dict, evictable keys in a set, and a lazy min-heap of `(rank, key)`."""

    name = "lru"

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._ranks: dict[int, Rank] = {}  # every resident key, pending and pinned too
        self._evictable: set[int] = set()
        # NOTE: entries go stale when a key's rank changes or it stops being
        # evictable; a popped entry counts only if it is still the key's rank.
        self._heap: list[tuple[Rank, int]] = []
        self._next_rank = 0
        self._request_ranks: dict[str, int] = {}

    def _request_rank(self, req: str) -> int:
        """The request's rank, drawn from the counter the first time it touches the policy."""
        rank = self._request_ranks.get(req)
        if rank is None:
            self._next_rank += 1
            rank = self._request_ranks[req] = self._next_rank
        return rank

    def _push(self, key: int) -> None:
        heapq.heappush(self._heap, (self._ranks[key], key))

    def _compact(self) -> None:
        """Drop the stale entries once they outnumber the live ones (vLLM's `_maybe_compact_heap`)."""
        if len(self._heap) >= max(64, 2 * len(self._evictable)):
            self._heap = [(self._ranks[key], key) for key in self._evictable]
            heapq.heapify(self._heap)

    def insert(self, key: int, req: str, position: int) -> None:
        """A new chunk, store in flight (so not yet evictable), ranked with its request."""
        self._ranks[key] = _rank(self._request_rank(req), position)

    def remove(self, key: int) -> None:
        """A failed store's chunk leaves the tier."""
        self._ranks.pop(key, None)
        self._evictable.discard(key)

    def mark_evictable(self, key: int) -> None:
        """Ref count reached 0: the chunk enters the heap with its current rank, unrefreshed."""
        self._evictable.add(key)
        self._push(key)
        self._compact()

    def mark_non_evictable(self, key: int) -> None:
        self._evictable.remove(key)

    def on_store_miss(self, keys: Sequence[int]) -> None:
        """Nothing: vLLM's default hook touches the keys, and store misses are never resident."""

    def on_request_access(self, req: str, keys: Sequence[int], positions: Sequence[int]) -> None:
        """Keys the running request sees for the first time: raise resident ones to its provisional rank."""
        request_rank = self._request_rank(req)
        pushed = False
        for key, position in zip(keys, positions, strict=True):
            old = self._ranks.get(key)
            rank = _rank(request_rank, position)
            if old is None or old >= rank:
                continue
            self._ranks[key] = rank
            if key in self._evictable:
                self._push(key)
                pushed = True
        if pushed:
            self._compact()

    def on_request_finished(self, req: str, keys: Sequence[int], insertion_only: set[int],
                            reused: set[int]) -> None:
        """Commit: fresh ranks to the request's resident keys (head to tail given), tail first."""
        self._request_ranks.pop(req, None)
        pushed = False
        for key in reversed(keys):
            if key in self._ranks:
                self._next_rank += 1
                self._ranks[key] = _rank(self._next_rank, 0)
                if key in self._evictable:
                    self._push(key)
                    pushed = True
        if pushed:
            self._compact()

    def evict(self, n: int, protected: set[int]) -> list[int] | None:
        """The `n` lowest-ranked evictable, unprotected keys, dropped; None (nothing changed) if too few."""
        if n == 0:
            return []
        picked: list[tuple[Rank, int]] = []
        picked_keys: set[int] = set()
        deferred: list[tuple[Rank, int]] = []
        heap = self._heap
        while heap and len(picked) < n:
            entry = heapq.heappop(heap)
            rank, key = entry
            if key not in self._evictable or self._ranks[key] != rank or key in picked_keys:
                continue  # stale, or a duplicate left by a pin and unpin at the same rank
            if key in protected:
                deferred.append(entry)
                continue
            picked.append(entry)
            picked_keys.add(key)
        for entry in deferred:
            heapq.heappush(heap, entry)
        if len(picked) < n:
            for entry in picked:
                heapq.heappush(heap, entry)
            return None
        for _, key in picked:
            self._evictable.remove(key)
            del self._ranks[key]
        self._compact()
        return [key for _, key in picked]

    def clear(self) -> None:
        """Forget every chunk and request; the rank counter restarts."""
        self._ranks.clear()
        self._evictable.clear()
        self._heap.clear()
        self._request_ranks.clear()
        self._next_rank = 0
