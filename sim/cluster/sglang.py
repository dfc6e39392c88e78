"""SGLang router's cache-aware policy: follow the longest cached prefix while the workers' loads
are balanced, the shortest queue once they are not.

Follows sgl-project/sglang at commit 026f853, sgl-router/src/policies/cache_aware.rs
(`CacheAwarePolicy::select_worker`), over the approximate tree of `sim.cluster.radix_tree`, with
the defaults of sgl-router's py_src/sglang_router/router_args.py (`RouterArgs`: cache_threshold
0.3, balance_abs_threshold 64, balance_rel_threshold 1.5, eviction_interval_secs 120, max_tree_size
2**26). The request text is kvsim's four characters a token (`sim.cluster.text`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvsim.sim.cluster.radix_tree import ApproxRadixTree
from kvsim.sim.cluster.text import prompt_text
from kvsim.sim.engine.config import SimConfig
from kvsim.workloads.request import Request

if TYPE_CHECKING:  # routers.py registers this router
    from kvsim.sim.cluster.routers import RouterView


class SglangCacheAware:
    """`CacheAwarePolicy` over one tree whose tenants are the replicas (`init_workers` inserts ""
    for each, so every replica starts holding 0 characters).

    A pick: with loads the router's own in-flight counts (`Worker::load`: requests it sent and has
    not seen answered; `view.outstanding`), the system is imbalanced when max - min > `balance_abs`
    and max > min x `balance_rel` (f32, as the source); then the first least-loaded replica gets
    the request. Otherwise the match rate (characters matched over the text's, f32) above
    `cache_threshold` sends it to the matched tenant, else to the replica holding the fewest
    characters. Either way the text is inserted for the chosen replica at once.

    The eviction thread (`with_config`) wakes every `eviction_interval` seconds from the start and
    trims each tenant to `tree_size` characters (`evict_tenant_by_size`; the source's comment says
    nodes, its code counts characters). kvsim runs a due eviction at the first pick at or after its
    time: the tree changes only at picks, and a second eviction with no pick between finds nothing."""

    def __init__(self, num_replicas: int, seed: int = 0, *, cache_threshold: float = 0.3, balance_abs: int = 64,
                 balance_rel: float = 1.5, tree_size: int = 2**26, eviction_interval: float = 120.0):
        self.num_replicas = num_replicas
        self.cache_threshold = np.float32(cache_threshold)
        self.balance_abs = balance_abs
        self.balance_rel = np.float32(balance_rel)
        self.tree_size = tree_size
        self.eviction_interval = eviction_interval
        self.next_eviction = eviction_interval
        self.tree = ApproxRadixTree()
        self.clock = 0  # touch times: one tick a match or insert
        for i in range(num_replicas):
            self.tree.insert("", i, self._tick())

    @classmethod
    def from_config(cls, cfg: SimConfig, num_replicas: int, num_blocks: int) -> SglangCacheAware:
        """The policy with `cfg`'s thresholds and tree limits (`num_blocks` unused: the tree is
        bounded in characters, not by the workers' caches)."""
        return cls(num_replicas, cfg.seed, cache_threshold=cfg.router_cache_threshold, balance_abs=cfg.router_balance_abs,
                   balance_rel=cfg.router_balance_rel, tree_size=cfg.router_tree_size,
                   eviction_interval=cfg.router_eviction_interval)

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def _evict_if_due(self, now: float) -> None:
        if now >= self.next_eviction:
            self.tree.evict_by_size(self.tree_size)
            self.next_eviction = (now // self.eviction_interval + 1) * self.eviction_interval

    def imbalanced(self, loads: list[int]) -> bool:
        """`is_imbalanced`: max - min > balance_abs and max > min x balance_rel."""
        high, low = max(loads), min(loads)
        return high - low > self.balance_abs and np.float32(high) > np.float32(low) * self.balance_rel

    def pick(self, request: Request, view: RouterView) -> int:
        self._evict_if_due(view.now)
        text = prompt_text(request)
        loads = [view.outstanding(i) for i in range(self.num_replicas)]
        if self.imbalanced(loads):
            chosen = loads.index(min(loads))  # min_by_key: the first least-loaded
        else:
            matched, tenant = self.tree.prefix_match(text, self._tick())
            rate = np.float32(matched) / np.float32(len(text)) if text else np.float32(0.0)
            chosen = tenant if rate > self.cache_threshold else self.tree.smallest_tenant()
            if chosen is None:  # no tenant at all: the source's "empty": its first healthy worker, no insert
                return 0
        self.tree.insert(text, chosen, self._tick())
        return chosen
