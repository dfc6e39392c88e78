"""LRU over the host tier's chunks, as vLLM 0.33's `LRUCachePolicy` (vllm/v1/kv_offload/cpu/policies/lru.py).

Every resident chunk has a rank, a pair; the victim is the smallest rank among
the evictable (ready, unpinned) chunks that the current offer does not protect.
While a request runs, the chunks it stores or first sees share its request rank,
tail first: `(request_rank, -position)`. When it finishes, every chunk it saw
that is still resident gets a fresh rank, tail first, so its head is the most
recently used. Request ranks and fresh ranks come from one counter.

A rank is kept as one int, `counter << 40 | (2**39 - position)`: the pairs' order (positions stay far
below 2**39). vLLM keeps a lazy min-heap of (rank, key) entries; so does this one, an entry one int,
`rank << 64 | key` (keys are 64-bit block hashes), the pairs' order, so `heapq` compares ints. An
eviction pops the entries in order, skipping stale ones and setting the protected ones aside (pushed
back after), so it picks the lowest live, unprotected entries. (A sorted list with the new entries
merged in at each eviction picked the same victims, but its sort read the whole list each time: 2.4 ms
an eviction at 40,000 entries, where popping the few hundred victims from the heap takes a fraction.)
"""

from __future__ import annotations

from collections.abc import Sequence
from heapq import heapify, heappop, heappush

Rank = int  # (counter, -position) as one int: see the module docstring
_TAIL = 1 << 39  # the rank of position p under a counter c is c << 40 | (_TAIL - p)
_KEY = (1 << 64) - 1  # an entry's key bits: entry = rank << 64 | key


def check_keys(keys: Sequence[int]) -> None:
    """Refuse keys that are not 64-bit block hashes (an entry holds its key in its low 64 bits);
    the host tier asks before it changes anything, so a refused offer leaves it as it was."""
    if keys and (min(keys) < 0 or max(keys) > _KEY):
        raise ValueError("host-tier keys must be 64-bit block hashes (0 <= key < 2**64)")


def _rank(counter: int, position: int) -> Rank:
    """The rank of `(counter, -position)`, order kept."""
    return (counter << 40) | (_TAIL - position)


class HostLRU:
    """Ranks in a dict, evictable keys in a set, and the lazy entries `rank << 64 | key` in a min-heap."""

    name = "lru"
    hooks_store_misses = False  # `on_store_miss` does nothing: the tier need not track misses

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._ranks: dict[int, Rank] = {}  # every resident key, pending and pinned too
        self._evictable: set[int] = set()
        # NOTE: entries go stale when a key's rank changes or it stops being
        # evictable; an entry read counts only if it is still the key's rank.
        self._heap: list[int] = []  # the entries, a heap (`heapq`)
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
        heappush(self._heap, self._ranks[key] << 64 | key)

    def _compact(self) -> None:
        """Drop the stale entries once they outnumber the live ones (vLLM's `_maybe_compact_heap`)."""
        if len(self._heap) >= max(64, 2 * len(self._evictable)):
            ranks = self._ranks
            self._heap = heap = [ranks[key] << 64 | key for key in self._evictable]
            heapify(heap)

    def insert(self, keys: Sequence[int], req: str, positions: Sequence[int]) -> None:
        """New chunks, stores in flight (so not yet evictable), ranked with their request. Keys are
        64-bit block hashes (an entry holds one in its low 64 bits)."""
        check_keys(keys)
        ranks, top = self._ranks, self._request_rank(req) << 40 | _TAIL  # (`_rank` inline)
        for key, position in zip(keys, positions, strict=True):
            ranks[key] = top - position

    def remove(self, key: int) -> None:
        """A failed store's chunk leaves the tier."""
        self._ranks.pop(key, None)
        self._evictable.discard(key)

    def mark_evictable(self, keys: Sequence[int]) -> None:
        """Ref counts reached 0: the chunks get entries with their current ranks, unrefreshed.
        (A victim is the smallest live entry whatever stale entries are kept, so compacting once after
        them all picks what compacting after each would.)"""
        self._evictable.update(keys)
        ranks, heap = self._ranks, self._heap
        for key in keys:
            heappush(heap, ranks[key] << 64 | key)
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
            if old is None:  # not resident (a new store candidate)
                continue
            rank = _rank(request_rank, position)
            if old >= rank:
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
        ranks, evictable, heap = self._ranks, self._evictable, self._heap
        counter = self._next_rank
        pushed = False
        for key in reversed(keys):
            if key in ranks:
                counter += 1
                rank = ranks[key] = counter << 40 | _TAIL  # (`_rank(counter, 0)` inline)
                if key in evictable:
                    heappush(heap, rank << 64 | key)
                    pushed = True
        self._next_rank = counter
        if pushed:
            self._compact()

    def evict(self, n: int, protected: set[int]) -> list[int] | None:
        """The `n` lowest-ranked evictable, unprotected keys, dropped; None (nothing changed) if too few."""
        if n == 0:
            return []
        heap = self._heap
        picked: list[int] = []  # entries, `rank << 64 | key`, in order
        deferred: list[int] = []
        evictable, ranks = self._evictable, self._ranks
        last = -1
        while heap and len(picked) < n:
            entry = heappop(heap)
            if entry == last:  # a duplicate left by a pin and unpin at the same rank: equal entries pop in turn
                continue
            last = entry
            key = entry & _KEY
            if key not in evictable or ranks[key] != entry >> 64:
                continue  # stale: popped for good
            if key in protected:
                deferred.append(entry)
                continue
            picked.append(entry)
        for entry in deferred:
            heappush(heap, entry)
        if len(picked) < n:  # every entry popped: the live ones go back (the stale ones are gone)
            for entry in picked:
                heappush(heap, entry)
            return None
        keys = [entry & _KEY for entry in picked]
        for key in keys:
            evictable.remove(key)
            del ranks[key]
        self._compact()
        return keys

    def clear(self) -> None:
        """Forget every chunk and request; the rank counter restarts."""
        self._ranks.clear()
        self._evictable.clear()
        self._heap.clear()
        self._request_ranks.clear()
        self._next_rank = 0
