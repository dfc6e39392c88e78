"""The ideal prefix-cache hit rate of a workload in a model's KV-cache layout (`kvsim workload
stats --model`).

The workload's ideal hit rate (`workloads.stats`, an infinite cache) counts every cached block
of a prompt's prefix. A model that vLLM keeps in hybrid KV-cache groups gets less even with an
infinite cache: a hit must be one every group can resume from, and under vLLM's default sparse
retention a sliding window or a Mamba state keeps only what a later request was seen to resume
from (the replay boundary of each prompt, the junctions found at lookup), and Mamba state only
where a chunk ended. So the ideal in the layout is measured, not derived: a sequential cache
replay (`kvsim cache-replay`, one request at a time) through the model's own block manager over
a pool too large to evict from (every group room for every distinct block the workload writes,
and the longest request's). Order matters (what a junction makes reusable depends on what came
before), as it does in `vllm serve`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvsim.sim.engine.config import SimConfig
from kvsim.workloads.request import Workload
from kvsim.workloads.stats import WorkloadStats


def pool_blocks(stats: WorkloadStats, num_groups: int, longest: int) -> int:
    """Blocks (null block included) no replay of the workload evicts from: per group, every
    distinct prompt block, every output block and the longest request's, at `stats.block_size`."""
    bs = stats.block_size
    distinct = stats.full_blocks - stats.hit_blocks + stats.requests  # (each prompt's partial last block)
    per_group = distinct + -(-stats.output_tokens // bs) + stats.requests + -(-longest // bs) + 1
    return num_groups * per_group + 1


def layout_ideal(workload: Workload, cfg: SimConfig, stats: WorkloadStats,
                 progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """The replay's hit rate over `cfg`'s model in its groups (`stats` at the layout's block size):
    its tokens hit, their share of prompt tokens, and the pool it needed. ValueError when the pool
    would not fit this machine's memory (`BlockPool`'s check names the blocks). `progress(n)` hears
    of every 1,000th request replayed."""
    from kvsim.kvcache.replay import replay
    from kvsim.sim.engine.run import replay_manager

    longest = max((r.prompt_len + max(r.output_len, 1) for r in workload), default=1)
    probe = replay_manager(cfg, 2)  # (the groups' count; a two-block pool costs nothing)
    blocks = pool_blocks(stats, probe.num_groups, longest)
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
