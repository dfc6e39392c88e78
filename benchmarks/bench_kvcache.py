"""Benchmark: sequential cache replay of the Mooncake conversation trace.

    python benchmarks/bench_kvcache.py [--trace PATH] [--block-size 16] [--num-blocks 100000]

Target (issue 3): the whole trace in <= 40 s on one core. Block operations
counted: blocks allocated, freed and evicted, and cache hits taken.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

from kvsim.kvcache.manager import KVCacheManager
from kvsim.kvcache.replay import replay
from kvsim.workloads.traces import load_workload

TRACE = Path(__file__).resolve().parents[1].parent / "shared/traces/mooncake/conversation_trace.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=100_000)
    ap.add_argument("--eviction", default="lru")
    args = ap.parse_args()

    manager = KVCacheManager(args.num_blocks, args.block_size, eviction=args.eviction, track_ids=False)
    allocated = 0
    get_new = manager.pool.get_new_blocks

    inside = False  # within take_one, whose fallback is get_new_blocks(1): counted once

    def counting_get_new(n):
        nonlocal allocated
        if not inside:
            allocated += n
        return get_new(n)

    manager.pool.get_new_blocks = counting_get_new
    take_one = manager.pool.take_one

    def counting_take_one():  # (a decode's one block: `decode_slot` takes it without get_new_blocks)
        nonlocal allocated, inside
        allocated += 1
        inside = True
        try:
            return take_one()
        finally:
            inside = False

    manager.pool.take_one = counting_take_one
    t0 = time.perf_counter()
    result = replay(load_workload(args.trace), manager)
    wall = time.perf_counter() - t0
    ops = allocated + manager.ops.counts["free"] + manager.ops.counts["evict"] + result.hit_tokens // args.block_size
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({
        "trace": args.trace.name, "block_size": args.block_size, "num_blocks": args.num_blocks,
        "eviction": args.eviction, "wall_s": round(wall, 2), "requests": result.requests,
        "requests_per_s": round(result.requests / wall, 1), "block_ops": ops,
        "block_ops_per_s": round(ops / wall), "peak_rss_mb": round(peak_mb, 1),
        "hit_rate": round(result.hit_rate, 6), "evicted_blocks": result.evicted_blocks,
    }, indent=1))


if __name__ == "__main__":
    main()
