"""The routers a cluster's requests pass through, and what each one sees when it picks.

A router is an object with `pick(request, view) -> replica index`. Its view (`RouterView`) is
what a real router sees: its own counters (requests it dispatched to each replica and saw
finish) are fresh; the engines' metrics (waiting, running, KV-cache usage) are a snapshot the
cluster refreshes every `SimConfig.router_metrics_interval` seconds, as vLLM's DP coordinator
publishes them (`vllm/v1/engine/coordinator.py`, every 100 ms by default) and llm-d scrapes
them (50 ms). Each router's docstring names the source it follows.
"""

from __future__ import annotations

import bisect
import hashlib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvsim.sim.cluster.kv_routers import Dynamo, LlmdPrecise
from kvsim.sim.cluster.llmd import LlmD
from kvsim.sim.cluster.sglang import SglangCacheAware
from kvsim.sim.engine.config import SimConfig
from kvsim.workloads.request import Request

if TYPE_CHECKING:
    from kvsim.sim.engine.config import SimConfig


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """One replica's engine metrics as a snapshot carries them (vLLM's SchedulerStats:
    num_waiting_reqs, num_running_reqs, kv_cache_usage)."""

    waiting: int
    running: int
    kv_usage: float  # vLLM's BlockPool.get_usage: 1 - free blocks / (blocks - the null block)


class RouterView:
    """What a router sees at a pick: fresh router-local counters, stale engine metrics."""

    def __init__(self, num_replicas: int):
        self.num_replicas = num_replicas
        self.dispatched = [0] * num_replicas  # requests this router sent to each replica
        self.finished = [0] * num_replicas  # of those, the ones it saw finish (or be dropped)
        self.metrics: tuple[EngineMetrics, ...] = (EngineMetrics(0, 0, 0.0),) * num_replicas
        self.metrics_time = 0.0  # when `metrics` was taken
        self.snapshots = 0  # snapshots taken so far (a router keeps its own copy until the next)
        self.now = 0.0  # the time of the pick
        # whether a request's first token has reached the router by now (the cluster sets it)
        self.prefilled: Callable[[str], bool] = lambda request_id: False

    def outstanding(self, replica: int) -> int:
        """Requests sent to `replica` and not yet seen finished (vLLM's `engine_inflight`)."""
        return self.dispatched[replica] - self.finished[replica]


class Router(Protocol):
    """What the cluster asks of a router; `reads_metrics` (default False) asks for snapshots.
    `oblivious` (default False): its picks depend only on the requests in order, its seed and its
    own dispatch counts (`RouterView.dispatched`), never on what the replicas did, so the
    replicas never interact and may run apart (`sim.cluster.parallel`)."""

    def pick(self, request: Request, view: RouterView) -> int: ...


class RoundRobin:
    """Replica k mod N for the k-th request: vLLM production-stack's `RoundRobinRouter.route_request`
    (src/vllm_router/routers/routing_logic.py, commit 5ae0b10: `req_id % len(endpoints)`)."""

    oblivious = True

    def __init__(self, num_replicas: int, seed: int = 0):
        self.num_replicas = num_replicas
        self.count = 0

    def pick(self, request: Request, view: RouterView) -> int:
        i = self.count % self.num_replicas
        self.count += 1
        return i


class RandomPick:
    """A uniform draw: Vidur's `RandomGlobalScheduler.schedule`
    (vidur/scheduler/global_scheduler/random_global_scheduler.py, commit 3b2237e:
    `randint(1, num_replicas) - 1`), from a generator seeded by the config's seed."""

    oblivious = True

    def __init__(self, num_replicas: int, seed: int = 0):
        self.num_replicas = num_replicas
        self.rng = random.Random(seed)

    def pick(self, request: Request, view: RouterView) -> int:
        return self.rng.randint(1, self.num_replicas) - 1


class LeastOutstanding:
    """The replica with the fewest outstanding requests, the lowest index on a tie: Vidur's
    `LORGlobalScheduler.schedule` (vidur/scheduler/global_scheduler/lor_global_scheduler.py, commit
    e26eb8f: `min(pending_requests_map.items(), key=...)`). Vidur reads its replica's pending count
    directly; a real router knows only its own counters, so outstanding here is dispatched minus
    seen finished (fresh)."""

    def __init__(self, num_replicas: int, seed: int = 0):
        self.num_replicas = num_replicas

    def pick(self, request: Request, view: RouterView) -> int:
        return min(range(self.num_replicas), key=view.outstanding)


class VllmDP:
    """vLLM 0.33.0's internal data-parallel balancer, `DPLBAsyncMPClient.get_core_engine_for_request`
    (vllm/v1/engine/core_client.py), with one front-end client (client_count 1, client_index 0).

    Scanning from a start index that rotates by one each pick, the first replica with the lowest
    score wins, score = max(in-flight, waiting + running) (+ waiting * 6 * max(0, KV usage - 0.5)
    when it has waiting requests): in-flight is the client's own count (fresh), waiting, running
    and usage the coordinator's latest snapshot. The client adds each pick to its copy of the
    snapshot's waiting count until the next snapshot replaces the copy (`current_counts[eng_index][0]
    += self.client_count`)."""

    reads_metrics = True

    def __init__(self, num_replicas: int, seed: int = 0):
        self.num_replicas = num_replicas
        self.start = 0  # eng_start_index: (num_engines * client_index) // client_count
        self.counts: list[list[float]] = []  # the client's copy of [waiting, running, usage]
        self.seen = -1  # the snapshot the copy was taken from

    def _counts(self, view: RouterView) -> list[list[float]]:
        if self.seen != view.snapshots:
            self.counts = [[m.waiting, m.running, m.kv_usage] for m in view.metrics]
            self.seen = view.snapshots
        return self.counts

    def score(self, replica: int, counts: Sequence[float], view: RouterView) -> float:
        waiting, running, usage = counts
        score = max(view.outstanding(replica), waiting + running)
        if waiting:
            score += waiting * 6.0 * max(0.0, usage - 0.5)
        return score

    def pick(self, request: Request, view: RouterView) -> int:
        counts = self._counts(view)
        n = self.num_replicas
        best, chosen = float("inf"), 0
        for i in range(n):
            idx = (self.start + i) % n
            s = self.score(idx, counts[idx], view)
            if s < best:
                best, chosen = s, idx
        counts[chosen][0] += 1
        self.start = self._next_start(n)
        return chosen

    def _next_start(self, n: int) -> int:
        return (self.start + 1) % n


class VllmDPLegacy(VllmDP):
    """vLLM's balancer before it weighed KV usage, its own in-flight count and rotated its scan:
    `DPLBAsyncMPClient.get_core_engine_for_request` (vllm/v1/engine/core_client.py) of the releases
    that introduced it (the v0.9 line; the last release with it is not pinned here), the rule BLIS
    and LLMServingSim model: score = 4 x waiting + running from the snapshot, the scan always from
    index 0 (client_index 0), the pick added to the copy's waiting count."""

    def score(self, replica: int, counts: Sequence[float], view: RouterView) -> float:
        return counts[0] * 4 + counts[1]

    def _next_start(self, n: int) -> int:
        return self.start


class SessionAffinity:
    """A session's requests go where its id hashes on a consistent-hash ring: vLLM production-stack's
    `SessionRouter.route_request` (src/vllm_router/routers/routing_logic.py, commit 5ae0b10), whose
    ring is uhashring's default `HashRing()` (uhashring 2.5, ring_meta.py): 160 points a node, a
    point int(md5(f"{node}-{w}"), 16), a key on the first point above its own md5 (bisect_right,
    wrapping to the first). Replica i is node `replica-i`. A request with no session goes to the
    replica that has had the fewest requests (lowest index on a tie), where production-stack picks
    the lowest QPS over its stats window (`_qps_routing`)."""

    VNODES = 160
    oblivious = True  # (a request with no session reads only the dispatch counts)

    def __init__(self, num_replicas: int, seed: int = 0):
        self.num_replicas = num_replicas
        ring: dict[int, int] = {}
        for i in range(num_replicas):
            for w in range(self.VNODES):
                ring[_md5_int(f"replica-{i}-{w}")] = i
        self.points = sorted(ring)
        self.owner = [ring[p] for p in self.points]

    def node(self, key: str) -> int:
        """The replica owning `key` on the ring (uhashring's `get_node`)."""
        p = bisect.bisect(self.points, _md5_int(key))
        return self.owner[p if p < len(self.points) else 0]

    def pick(self, request: Request, view: RouterView) -> int:
        if request.session is None:
            return min(range(self.num_replicas), key=lambda i: view.dispatched[i])
        return self.node(request.session)


def _md5_int(key: str) -> int:
    return int(hashlib.md5(key.encode("utf-8")).hexdigest(), 16)


ROUTERS = {"round-robin": RoundRobin, "random": RandomPick, "least-outstanding": LeastOutstanding,
           "vllm-dp": VllmDP, "vllm-dp-legacy": VllmDPLegacy, "session-affinity": SessionAffinity,
           "llm-d-precise": LlmdPrecise, "dynamo": Dynamo,  # fed by KV events (kv_routers.py)
           "llm-d": LlmD, "sglang-cache-aware": SglangCacheAware}  # the text-hashing ones in llmd.py, sglang.py


def make_router(name: str, num_replicas: int, seed: int = 0, cfg: SimConfig | None = None, num_blocks: int = 0) -> Router:
    """The router `name` (a `SimConfig.router` value) over `num_replicas` replicas; one with options
    (`from_config`) takes them from `cfg`, and the replicas' GPU blocks (`num_blocks`) where it sizes by them."""
    cls = ROUTERS[name]
    if cfg is not None and hasattr(cls, "from_config"):
        return cls.from_config(cfg, num_replicas, num_blocks)
    return cls(num_replicas, seed)
