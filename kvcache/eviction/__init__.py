"""Eviction policies: which free block is reused next. The one place that names them.

LRU is vLLM V1 exactly (the default); every other policy reuses uncached free
blocks first and ranks only the cached, evictable ones (see `CachedPolicy`).
Each policy keeps its per-block data itself, keyed by block id.

To add a policy:
1. write one class in its own module here, subclassing `CachedPolicy`: implement
   `_insert`, `_discard` and `_victim`, plus whichever hooks it needs (`bind`,
   `on_cache`, `on_hit`, `on_evict`), with a unique `name`;
2. add it to `POLICIES` below;
3. write one test, `tests/kvcache/test_<name>.py`, with exact expected victims.
"""

from __future__ import annotations

from kvsim.kvcache.eviction.arc import ARC
from kvsim.kvcache.eviction.base import CachedPolicy, EvictionPolicy
from kvsim.kvcache.eviction.heap import FIFO, LFU, CostAware
from kvsim.kvcache.eviction.lru import LRU, PinnedLRU
from kvsim.kvcache.eviction.s3fifo import S3FIFO

__all__ = [
    "ARC", "FIFO", "LFU", "LRU", "POLICIES", "S3FIFO", "CachedPolicy", "CostAware",
    "EvictionPolicy", "PinnedLRU", "check_policy", "make_policy",
]

POLICIES: dict[str, type[EvictionPolicy]] = {
    p.name: p for p in (LRU, LFU, FIFO, S3FIFO, CostAware, PinnedLRU, ARC)
}


def check_policy(name: str) -> None:
    """Raise ValueError naming the choices unless `name` is a known policy."""
    if name not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; choose from {', '.join(POLICIES)}")


def make_policy(name: str, block_size: int = 16) -> EvictionPolicy:
    """Build a policy by name (`block_size` matters to the cost-aware one)."""
    check_policy(name)
    if name == "cost":
        return CostAware(block_size)
    return POLICIES[name]()
