"""KV offloading to host (CPU) memory, as vLLM 0.33's native `--kv-offloading-size`.

`tier.HostTier` holds the offloaded chunks (slots, ref counts, store admission),
`size.num_host_chunks` turns a size in GiB into chunks, and `lru` and `arc` are
the tier's two eviction policies (vLLM's `eviction_policy`), named here.
"""

from __future__ import annotations

from kvsim.kvcache.offload.arc import HostARC
from kvsim.kvcache.offload.lru import HostLRU

__all__ = ["OFFLOAD_POLICIES", "HostARC", "HostLRU", "make_policy"]

OFFLOAD_POLICIES = ("lru", "arc")


def make_policy(name: str, capacity: int) -> HostLRU | HostARC:
    """The host tier's eviction policy `name` over `capacity` chunks."""
    if name == "lru":
        return HostLRU(capacity)
    if name == "arc":
        return HostARC(capacity)
    raise ValueError(f"unknown offload eviction policy {name!r}; choose from {', '.join(OFFLOAD_POLICIES)}")
