"""The ideal prefix-cache hit rate of a workload in a model's KV-cache layout (`kvsim workload
stats --model`).

The workload's ideal hit rate (`workloads.stats`, an infinite cache) counts every cached block
of a prompt's prefix. A model that vLLM keeps in hybrid KV-cache groups gets less even with an
infinite cache: a hit must be one every group can resume from, and under vLLM's default sparse
retention a sliding window or a Mamba state keeps only what a later request was seen to resume
from (the replay boundary of each prompt, the junctions found at lookup), and Mamba state only
where a chunk ended. So the ideal in the layout is measured, not derived: a sequential cache
replay (`kvsim cache-replay`, one request at a time) through the model's own block manager over
a pool too large to evict from (`pool_blocks`: each group room for every block it may hash, and
the longest request's). Order matters (what a junction makes reusable depends on what came
before), as it does in `vllm serve`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvsim.kvcache.groups import GroupSpec
from kvsim.kvcache.sliding_window import contiguous_blocks_needed
from kvsim.sim.engine.config import SimConfig
from kvsim.workloads.request import Workload
from kvsim.workloads.stats import WorkloadStats


def pool_blocks(stats: WorkloadStats, groups: Sequence[GroupSpec], longest: int, retention: int | None) -> int:
    """Blocks (null block included) no replay of the workload evicts from, summed over `groups` at
    `stats.block_size`. Every group needs room for the longest request's blocks and for every
    block it may hash:
    - a sliding window under vLLM's default sparse retention (`retention` 0) hashes only the tails
      a later request can resume from (`sliding_window.retained_ranges`): at most
      `contiguous_blocks_needed` blocks before each of a request's two boundaries (its replay
      boundary and a shared-prefix junction);
    - any other group hashes every block it fills: each output block and, alone, each prompt
      block the ideal cache does not hit; beside other groups, whose hit may be shorter than its
      own, each prompt block (what it recomputes past the agreed hit it hashes again)."""
    bs = stats.block_size
    live = -(-longest // bs) + 1
    tails = [stats.requests * 2 * contiguous_blocks_needed(g.window, bs) + live
             for g in groups if g.kind == "sliding_window" and retention == 0]
    prompt = stats.full_blocks - (stats.hit_blocks if len(groups) == 1 else 0) + stats.requests  # (+ partial last)
    every = prompt + -(-stats.output_tokens // bs) + stats.requests + live
    return 1 + sum(tails) + (len(groups) - len(tails)) * every


def layout_ideal(workload: Workload, cfg: SimConfig, stats: WorkloadStats,
                 progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """The replay's hit rate over `cfg`'s model in its groups (`stats` at the layout's block size):
    its tokens hit, their share of prompt tokens, and the pool it needed. ValueError when the pool
    would not fit this machine's memory (`BlockPool`'s check names the blocks). `progress(n)` hears
    of every 1,000th request replayed."""
    from kvsim.kvcache.replay import replay
    from kvsim.sim.engine.run import replay_manager

    longest = max((r.prompt_len + max(r.output_len, 1) for r in workload), default=1)
    probe = replay_manager(cfg, 2)  # (the groups and their retention; a two-block pool costs nothing)
    groups = getattr(probe, "groups", (GroupSpec("full", probe.block_size),))
    blocks = pool_blocks(stats, groups, longest, getattr(probe, "retention_interval", None))
    m = replay_manager(cfg, blocks)
    done = [0]

    def count(_rec: Any) -> None:
        done[0] += 1
        if progress is not None and not done[0] % 1000:
            progress(done[0])

    r = replay(workload, m, 1, count)
    if r.evicted_blocks:  # the bound above is meant to make this impossible
        raise RuntimeError(f"the ideal replay evicted {r.evicted_blocks} blocks from {blocks:,}")
    return {"hit_tokens": r.hit_tokens, "hit_rate": r.hit_rate, "pool_blocks": blocks,
            "groups": m.num_groups, "block_size": m.block_size}
