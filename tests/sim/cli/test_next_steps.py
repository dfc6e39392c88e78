"""The commands `kvsim run` suggests next fit what the run showed (sim/cli/run.py next_steps)."""

from __future__ import annotations

from pathlib import Path

from kvsim.sim.cli.run import next_steps
from kvsim.sim.engine.config import SimConfig

W = Path("shared.jsonl")
OUT = Path("runs/shared-x")


def summary(**kw: float) -> dict:
    return {"requests": 500, "hit_rate": 0.5, "evictions": 10, "num_gpu_blocks": 1000,
            "peak_block_usage": 1.0, "peak_used_blocks": 1000, **kw}


def test_evicting_run_compares_the_policy_at_the_same_size() -> None:
    assert next_steps(W, "auto", [], {}, SimConfig(), OUT, summary()) == [
        "# the same run under s3fifo, side by side with this one",
        "kvsim run shared.jsonl --eviction s3fifo -o runs/shared-s3fifo && "
        "kvsim compare runs/shared-x runs/shared-s3fifo",
        "# prefix hit rate against cache size, one line per policy (cache replay)",
        "kvsim curve shared.jsonl -c 250,500,1000,2000 -p lru,s3fifo,arc,lfu,fifo",
    ]


def test_run_without_evictions_suggests_a_cache_half_its_peak_use() -> None:
    s = summary(evictions=0, num_gpu_blocks=27_816, peak_block_usage=0.0176, peak_used_blocks=490)
    assert next_steps(W, "auto", ["--no-plots"], {}, SimConfig(), OUT, s)[:2] == [
        "# policies apart: two runs in a 245-block cache (half this run's peak use)",
        "kvsim run shared.jsonl --no-plots --num-gpu-blocks 245 --eviction lru -o runs/shared-245-lru && "
        "kvsim run shared.jsonl --no-plots --num-gpu-blocks 245 --eviction s3fifo -o runs/shared-245-s3fifo && "
        "kvsim compare runs/shared-245-lru runs/shared-245-s3fifo",
    ]


def test_run_without_any_hit_points_to_a_workload_with_shared_prefixes() -> None:
    assert next_steps(W, "auto", [], {}, SimConfig(), OUT, summary(hit_rate=0.0)) == [
        "# nothing hit the prefix cache (no two prompts share a prefix), so every eviction",
        "# policy gives the same result here; a workload with shared prefixes shows them apart:",
        "kvsim workload generate shared-prefix -n 500 -o shared.jsonl && kvsim run shared.jsonl",
    ]
