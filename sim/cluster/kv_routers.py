"""The routers fed by the replicas' KV events: llm-d's precise prefix-cache profile and NVIDIA
Dynamo's KV router. Each keeps a `PrefixIndex` (`sim.cluster.kv_index`) the cluster feeds with
every batch once it is due (`SimConfig.kv_event_delay` after its step ended), and reads it, the
router's own counters and the engine-metric snapshot (`RouterView`) when it picks.
"""

from __future__ import annotations

import math
import random
from typing import TYPE_CHECKING

from kvsim.kvcache.hashing import block_keys
from kvsim.sim.cluster.kv_index import PrefixIndex
from kvsim.sim.engine.config import parse_router_scorers

if TYPE_CHECKING:
    from kvsim.sim.cluster.routers import RouterView
    from kvsim.sim.engine.config import SimConfig
    from kvsim.workloads.request import Request

# llm-d-kv-cache's default medium weights (pkg/kvcache/backend.go `DefaultKVCacheBackendConfig`,
# commit 7be76e1): a block on the GPU counts 1.0, one on the CPU tier 0.8
MEDIUM_WEIGHTS = {"gpu": 1.0, "cpu": 0.8}


class LlmdPrecise:
    """llm-d's precise prefix-cache profile: the weighted sum of its scorers, the highest wins, a
    tie drawn at random (seeded).

    The profile is llm-d-inference-scheduler's deploy/config/epp-precise-prefix-cache-config.yaml
    (commit 98debc4): precise-prefix-cache-scorer 2, kv-cache-utilization-scorer 1, queue-scorer 1,
    max-score-picker; `SimConfig.router_scorers` replaces the weights (a scorer not named is left
    out). Scorers, at llm-d-inference-scheduler commit 520af47 (pkg/epp/framework/plugins/scheduling/):
    - `prefix` (scorer/preciseprefixcache `Scorer.Score`, `getScores` token path, utils.go
      `absoluteScoredPods`): the pod's longest consecutive prefix of the request's block hashes,
      blocks weighted by medium (GPU 1.0, CPU 0.8), over the prompt's full blocks
      (floor(tokens / block size)), clipped to 1; 0 with no full block;
    - `kv-util` (scorer/kvcacheutilization `Score`): 1 - the snapshot's KV-cache usage;
    - `queue` (scorer/queuedepth `QueueScorer.Score`): (max waiting - waiting) / (max - min) over
      the pods, 1.0 when all wait alike.
    Each score is clamped to [0, 1] and added times its weight in the profile's order
    (scheduling/scheduler_profile.go `runScorerPlugins`, `enforceScoreRange`); the picker shuffles
    and sorts by score, so a tie goes to any of the tied pods alike (picker/maxscore `Pick`): here
    one draw among the tied replicas, only when there is a tie."""

    reads_metrics = True
    reads_events = True

    def __init__(self, num_replicas: int, seed: int = 0, *, block_size: int = 16,
                 weights: dict[str, float] | None = None):
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.weights = weights if weights is not None else parse_router_scorers(None)
        self.rng = random.Random(seed)
        self.index = PrefixIndex(num_replicas)

    @classmethod
    def from_config(cls, cfg: SimConfig, num_replicas: int, num_blocks: int = 0) -> LlmdPrecise:
        return cls(num_replicas, cfg.seed, block_size=cfg.block_size, weights=parse_router_scorers(cfg.router_scorers))

    def prefix_scores(self, request: Request) -> list[float]:
        total = request.prompt_len // self.block_size
        if total <= 0:
            return [0.0] * self.num_replicas
        raw = self.index.weighted_prefix(block_keys(request.prompt, self.block_size), MEDIUM_WEIGHTS)
        return [min(raw[i] / total, 1.0) if raw.get(i, 0.0) > 0 else 0.0 for i in range(self.num_replicas)]

    def scorer(self, name: str, request: Request, view: RouterView) -> list[float]:
        """One scorer's scores, a replica each."""
        if name == "prefix":
            return self.prefix_scores(request)
        if name == "kv-util":
            return [1 - m.kv_usage for m in view.metrics]
        waiting = [m.waiting for m in view.metrics]
        lo, hi = min(waiting), max(waiting)
        return [1.0 if hi == lo else (hi - w) / (hi - lo) for w in waiting]

    def scores(self, request: Request, view: RouterView) -> list[float]:
        """The profile's weighted sum, a replica each."""
        total = [0.0] * self.num_replicas
        for name, weight in self.weights.items():
            for i, s in enumerate(self.scorer(name, request, view)):
                total[i] += min(max(s, 0.0), 1.0) * weight
        return total

    def pick(self, request: Request, view: RouterView) -> int:
        scores = self.scores(request, view)
        best = max(scores)
        tied = [i for i, s in enumerate(scores) if s == best]
        chosen = tied[0] if len(tied) == 1 else tied[self.rng.randrange(len(tied))]
        # what it expects the replica to hit: the prompt's blocks its index says it holds from the first
        self.expected_tokens = self.index.overlaps(block_keys(request.prompt, self.block_size))[chosen] \
            * self.block_size
        return chosen


class Dynamo:
    """NVIDIA Dynamo's KV router (ai-dynamo/dynamo lib/llm/src/kv_router/scheduler.rs
    `DefaultWorkerSelector::select_worker` and sequence.rs `ActiveSequences`, the 2025 releases
    whose cost is `overlap_weight * prefill_blocks + decode_blocks`).

    For each worker, from its event-fed radix tree (`PrefixIndex.overlaps`: the request's full
    blocks it holds consecutively from the first) and the router's own record of the requests it
    sent there (`ActiveSequences`):
    - prefill_blocks = (the worker's active prefill tokens + max(0, prompt tokens - overlap x block
      size)) / block size, a request's prefill tokens counted from its dispatch until its first
      token (`add_request`, `new_tokens`, `mark_prefill_completed`);
    - decode_blocks = the worker's active blocks (distinct block hashes of the prompts it was sent
      and has not finished) + the request's blocks not among them (`potential_blocks`, `new_blocks`);
    - logit = overlap_weight (1.0) x prefill_blocks + decode_blocks; the lowest wins.
    Temperature 0 (the default): of the tied lowest, the smallest radix tree (blocks the worker
    holds), the lowest index among equal smallest (Rust's `min_by_key` over a HashMap: its order),
    and a seeded draw where every tied tree is the same size (`select_from_logits`). Temperature
    T > 0: a draw from softmax(-(logit / (max - min)) / T), uniform where all logits are equal
    (`softmax_sample`), replicas in index order."""

    reads_events = True

    def __init__(self, num_replicas: int, seed: int = 0, *, block_size: int = 16, temperature: float = 0.0,
                 overlap_weight: float = 1.0):
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.temperature = temperature
        self.overlap_weight = overlap_weight
        self.rng = random.Random(seed)
        self.index = PrefixIndex(num_replicas)
        self.blocks: list[dict[int, int]] = [{} for _ in range(num_replicas)]  # hash -> active requests holding it
        self.prefill_tokens = [0] * num_replicas
        self.active: dict[str, tuple[int, list[int], int]] = {}  # id -> (replica, keys, prefill tokens left)
        self.prefilling: dict[str, None] = {}  # of those, the ids with prefill tokens left (in `active`'s order)

    @classmethod
    def from_config(cls, cfg: SimConfig, num_replicas: int, num_blocks: int = 0) -> Dynamo:
        return cls(num_replicas, cfg.seed, block_size=cfg.block_size, temperature=cfg.router_temperature)

    def logits(self, request: Request, view: RouterView) -> tuple[list[float], list[int]]:
        """Each worker's cost, and the request's block hashes."""
        self._catch_up(view)
        keys = block_keys(request.prompt, self.block_size)
        overlaps = self.index.overlaps(keys)
        out = []
        distinct = set(keys)
        for i in range(self.num_replicas):
            new_tokens = max(request.prompt_len - overlaps[i] * self.block_size, 0)
            prefill_blocks = (self.prefill_tokens[i] + new_tokens) / self.block_size
            held = self.blocks[i]
            # the request's blocks not held (each key counted as often as it comes)
            if len(distinct) == len(keys):
                decode_blocks = len(held) + len(keys) - len(held.keys() & distinct)
            else:
                decode_blocks = len(held) + sum(1 for k in keys if k not in held)
            out.append(self.overlap_weight * prefill_blocks + decode_blocks)
        return out, keys

    def peek(self, request: Request, view: RouterView) -> int:
        """The worker `pick` would choose now, nothing booked (Dynamo's advisory selection, which the
        P/D load-aware deciders peek at; a tie drawn at random draws from the same generator)."""
        return self._select(self.logits(request, view)[0])

    def pick(self, request: Request, view: RouterView) -> int:
        logits, keys = self.logits(request, view)
        chosen = self._select(logits)
        overlap = self.index.overlaps(keys)[chosen] * self.block_size
        self.expected_tokens = overlap  # what it expects the replica to hit (its overlap)
        new_tokens = max(request.prompt_len - overlap, 0)
        self.active[request.id] = (chosen, keys, new_tokens)
        if new_tokens:
            self.prefilling[request.id] = None
        self.prefill_tokens[chosen] += new_tokens
        held = self.blocks[chosen]
        for k in keys:
            held[k] = held.get(k, 0) + 1
        return chosen

    def _select(self, logits: list[float]) -> int:
        n = self.num_replicas
        if self.temperature > 0:
            lo, hi = min(logits), max(logits)
            if lo == hi:
                probs = [1.0 / n] * n
            else:
                scaled = [-(v / (hi - lo)) / self.temperature for v in logits]
                top = max(scaled)
                weights = [math.exp(v - top) for v in scaled]
                probs = [w / sum(weights) for w in weights]
            sample, cumsum = self.rng.random(), 0.0
            for i, p in enumerate(probs):
                cumsum += p
                if sample <= cumsum:
                    return i
            return n - 1
        best = min(logits)
        tied = [i for i in range(n) if logits[i] == best]
        if len(tied) == 1:
            return tied[0]
        every = self.index.sizes
        sizes = [every[i] for i in tied]
        if all(s == sizes[0] for s in sizes):
            return tied[self.rng.randrange(len(tied))]
        return tied[sizes.index(min(sizes))]

    def _catch_up(self, view: RouterView) -> None:
        """What the router has heard by now: first tokens end a request's prefill tokens, finishes
        free its blocks (`mark_prefill_completed`, `free`)."""
        for rid in [rid for rid in self.prefilling if view.prefilled(rid)]:
            replica, keys, left = self.active[rid]
            self.prefill_tokens[replica] -= left
            self.active[rid] = (replica, keys, 0)
            del self.prefilling[rid]

    def finished(self, request: Request, replica: int) -> None:
        """`request` finished (or was dropped) on `replica`: its prefill tokens and blocks go."""
        entry = self.active.pop(request.id, None)
        if entry is None:
            return
        self.prefilling.pop(request.id, None)
        _, keys, left = entry
        self.prefill_tokens[replica] -= left
        held = self.blocks[replica]
        for k in keys:
            held[k] -= 1
            if not held[k]:
                del held[k]
