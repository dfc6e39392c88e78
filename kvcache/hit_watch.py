"""A blocked head's lookup, watched for what could change it: the hybrid manager's half of the
engine's blocked-head shortcut (`sim.engine.shortcuts.BlockedHead`, `sim.engine.quiet`).

A request at the head of WAITING that failed to allocate is not looked up again while its hit must
be what it was. Over vLLM's hybrid groups that hit stays the same while no key of its prefix is
added in any group (the manager's caching reports the keys it adds) and no block of the hit is
evicted. Keys outside the hit going do not change it: a group's hit is its run of cached blocks
(the first miss of full attention, the rightmost run of a window), which a missing key elsewhere
leaves as it is.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvsim.kvcache.block import KVCacheBlock


class HitWatch:
    """The watched head's keys (before any group's salt), whether one was added since, and its hit
    blocks with their keys, checked again only after an eviction."""

    def __init__(self) -> None:
        self.keys: set[int] = set()
        self.added = False
        self._evictions = 0
        self._hashes: list[tuple[KVCacheBlock, int | None]] = []

    def watch(self, keys: Iterable[int], hit_blocks: Iterable[KVCacheBlock], evictions: int) -> None:
        """Watch a lookup of `keys` that found `hit_blocks`, with the pool at `evictions` evictions."""
        self.keys = set(keys)
        self.added = False
        self._evictions = evictions
        self._hashes = [(b, b.block_hash) for b in hit_blocks]

    def caching(self, keys: list[int], start: int, end: int) -> None:
        """A group caches the blocks of `keys[start:end]` (keys before its salt)."""
        if self.keys and not self.added:
            watched = self.keys
            self.added = any(keys[i] in watched for i in range(start, end))

    def would_add(self, keys: list[int]) -> bool:
        """Whether caching blocks of these keys may add a watched one."""
        return bool(self.keys) and not self.keys.isdisjoint(keys)

    def unchanged(self, evictions: int) -> bool:
        """Whether the watched lookup gives the same blocks now, the pool at `evictions` evictions."""
        if self.added:
            return False
        if evictions != self._evictions:
            if any(b.block_hash != h for b, h in self._hashes):
                return False
            self._evictions = evictions
        return True
