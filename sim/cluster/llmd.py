"""llm-d's router: weighted scorers over every pod, then the max-score picker.

Follows llm-d-inference-scheduler (module llm-d-router) at commit 520af47: the chart's default
scheduling profile (config/charts/epplib/templates/_config.yaml: queue-scorer 2,
kv-cache-utilization-scorer 2, prefix-cache-scorer 3; no picker named, so `loader/defaults.go`
adds max-score-picker; the prefix scorer's match data come from the default producer for it,
approx-prefix-cache-producer, cmd/epp/runner/runner.go); `SchedulerProfile.runScorerPlugins`
(pkg/epp/scheduling/scheduler_profile.go: each scorer's score clamped to [0, 1] by
`enforceScoreRange`, times its weight, summed in the profile's order); and `MaxScorePicker.Pick`
(picker/maxscore/picker.go: shuffle, then a stable sort by score, the first wins: a random tie-break).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvsim.sim.cluster.approx_prefix import ApproxPrefixIndex
from kvsim.sim.cluster.text import CHARS_PER_TOKEN, prompt_bytes
from kvsim.sim.engine.config import ROUTER_SCORERS, SimConfig, parse_router_scorers
from kvsim.workloads.request import Request

if TYPE_CHECKING:  # routers.py registers this router
    from kvsim.sim.cluster.routers import EngineMetrics, RouterView


def queue_scores(metrics: Sequence[EngineMetrics]) -> list[float]:
    """`QueueScorer.Score` (scorer/queuedepth/queue.go): (max - waiting) / (max - min) over the
    pods' waiting queues in the metrics snapshot; 1.0 for every pod when all are equal."""
    waiting = [m.waiting for m in metrics]
    high, low = max(waiting), min(waiting)
    if high == low:
        return [1.0] * len(waiting)
    return [(high - w) / (high - low) for w in waiting]


def kv_util_scores(metrics: Sequence[EngineMetrics]) -> list[float]:
    """`KVCacheUtilizationScorer.Score` (scorer/kvcacheutilization/kvcache_utilization.go):
    1 - the snapshot's KV-cache usage (vLLM's kv_cache_usage_perc, a fraction)."""
    return [1.0 - m.kv_usage for m in metrics]


def prefix_scores(matches: dict[int, int], total: int, num_pods: int) -> list[float]:
    """The prefix-cache scorer's `Plugin.Score` (scorer/prefix/plugin.go): matched blocks over the
    prompt's blocks; 0 for a prompt shorter than one block (no blocks)."""
    return [matches.get(i, 0) / total if total else 0.0 for i in range(num_pods)]


def _clamp(score: float) -> float:
    """`enforceScoreRange` (scheduler_profile.go)."""
    return 0.0 if score < 0 else 1.0 if score > 1 else score


class LlmD:
    """llm-d with the approximate prefix index (`ApproxPrefixIndex`), reading the engines' waiting
    counts and KV usage from the router's latest metrics snapshot. `weights` maps scorer names
    ('queue', 'kv-util', 'prefix') to weights, summed in its order; the chart's profile by default.
    The picker's shuffle draws from a generator seeded by `seed` (llm-d seeds it from the clock;
    Python's shuffle, not Go's PCG: the same uniform tie-break, other draws). The index learns a
    prompt when the router sends it (the producer's `PreRequest`, before the request is served)."""

    reads_metrics = True

    def __init__(self, num_replicas: int, seed: int = 0, *, weights: dict[str, float] | None = None,
                 index: ApproxPrefixIndex | None = None):
        self.num_replicas = num_replicas
        self.weights = dict(ROUTER_SCORERS["llm-d"] if weights is None else weights)
        self.index = index if index is not None else ApproxPrefixIndex()
        self.rng = random.Random(seed)

    @classmethod
    def from_config(cls, cfg: SimConfig, num_replicas: int, num_blocks: int) -> LlmD:
        """The router `cfg` asks for, over pods of `num_blocks` GPU blocks each (autoTune: the LRU
        holds that many hashes and blocks are the engine's block size)."""
        weights = parse_router_scorers(cfg.router_scorers, "llm-d")
        index = ApproxPrefixIndex(cfg.block_size, num_blocks, cfg.model)
        return cls(num_replicas, cfg.seed, weights=weights, index=index)

    def scores(self, hashes: list[int], view: RouterView) -> list[float]:
        """Each pod's weighted score for a prompt of chain `hashes` (`runScorerPlugins`)."""
        n = self.num_replicas
        per_scorer = {"queue": lambda: queue_scores(view.metrics), "kv-util": lambda: kv_util_scores(view.metrics),
                      "prefix": lambda: prefix_scores(self.index.match(hashes), len(hashes), n)}
        total = [0.0] * n
        for name, weight in self.weights.items():
            for i, score in enumerate(per_scorer[name]()):
                total[i] += _clamp(score) * weight
        return total

    def pick(self, request: Request, view: RouterView) -> int:
        hashes = self.index.hashes(prompt_bytes(request))
        scores = self.scores(hashes, view)
        order = list(range(self.num_replicas))
        self.rng.shuffle(order)  # ShuffleScoredEndpoints, then the stable sort: the first best wins
        chosen = max(order, key=scores.__getitem__)
        # what it expects the pod to hit: its matched blocks' tokens (four characters a token)
        self.expected_tokens = min(self.index.match(hashes).get(chosen, 0) * self.index.block_chars // CHARS_PER_TOKEN,
                                   request.prompt_len)
        self.index.add(hashes, chosen)
        return chosen
