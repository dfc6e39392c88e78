"""Where a run's time goes in the block pool, timed inside a real `kvsim run`.

    python benchmarks/pool_costs.py [WORKLOAD] [kvsim run options ...]

The script wraps, in this process only, the pool's public block operations:
- `BlockPool.get_new_blocks` and `take_one` (a decode's one block): blocks taken. Under exact LRU it
  also counts those that come off the free queue's front stack (where the pool starts with every
  block, and freed uncached blocks go). The rest come off its linked part: each an eviction.
- `free_blocks` / `free_runs`: blocks let go.
- `cache_blocks`: blocks hashed into the prefix cache.

It also counts the engine's steps, quiet (`QuietRuns.run`, the async output's `AsyncQuietRuns.run`) and
general (`Scheduler.schedule`).
Then it runs `kvsim run WORKLOAD ... --no-plots`, into a scratch folder unless `--out` is given.
Without a workload it runs the embedded default one.

It prints a table and one JSON line: each operation's calls, blocks, seconds and nanoseconds a
block, and the run's wall time.

Each wrapper adds a timer call, so a run takes a little longer than without them. The figure to
read is the cost a block. Set it against the same operations on a warm pool
(`bench_kvcache.py`, or a loop over a few thousand blocks): the difference is what the blocks'
scattered memory costs inside a whole run.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from kvsim.kvcache.block_pool import BlockPool
from kvsim.sim.cli.app import app
from kvsim.sim.engine.async_quiet import AsyncQuietRuns
from kvsim.sim.engine.quiet import QuietRuns
from kvsim.sim.engine.scheduler import Scheduler

OPS = ("take", "free", "cache")


class Meter:
    """Calls, blocks and seconds for each operation. Only the outermost call of a nest counts:
    `free_runs` may call `free_blocks`."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.blocks: Counter[str] = Counter()
        self.seconds: Counter[str] = Counter()
        self.from_stack = 0
        self.steps: Counter[str] = Counter()
        self._depth = 0

    def wrap(self, op: str, fn: Callable[..., Any], blocks: Callable[..., int]) -> Callable[..., Any]:
        clock = time.perf_counter

        def timed(pool: BlockPool, *args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return fn(pool, *args, **kwargs)
            n = blocks(pool, *args, **kwargs)
            self._depth += 1
            t = clock()
            try:
                return fn(pool, *args, **kwargs)
            finally:
                self.seconds[op] += clock() - t
                self._depth -= 1
                self.calls[op] += 1
                self.blocks[op] += n

        return timed

    def install(self) -> None:
        def taken(pool: BlockPool, n: int, keys: Any = None) -> int:
            if pool._lru is not None:  # (under exact LRU: the front stack is taken first)
                self.from_stack += min(n, len(pool._lru.stack) + pool._lru.num_fresh)
            return n

        BlockPool.get_new_blocks = self.wrap("take", BlockPool.get_new_blocks, taken)
        BlockPool.take_one = self.wrap("take", BlockPool.take_one, lambda pool: taken(pool, 1))
        BlockPool.free_blocks = self.wrap("free", BlockPool.free_blocks, lambda pool, ordered: len(ordered))
        BlockPool.free_runs = self.wrap("free", BlockPool.free_runs, lambda pool, runs: sum(map(len, runs)))
        BlockPool.cache_blocks = self.wrap("cache", BlockPool.cache_blocks,
                                           lambda pool, blocks, keys, start, end, *a, **k: max(end - start, 0))
        schedule, quiet = Scheduler.schedule, QuietRuns.run
        steps = self.steps

        def general(sched: Scheduler, *args: Any, **kwargs: Any) -> Any:
            steps["general"] += 1
            return schedule(sched, *args, **kwargs)

        def counted(run: Callable[..., Any]) -> Callable[..., Any]:
            def quiet_run(runs: QuietRuns | AsyncQuietRuns, *args: Any, **kwargs: Any):
                before = runs.taken
                out = yield from run(runs, *args, **kwargs)
                steps["quiet"] += runs.taken - before
                return out
            return quiet_run

        Scheduler.schedule = general
        QuietRuns.run = counted(quiet)
        AsyncQuietRuns.run = counted(AsyncQuietRuns.run)

    def report(self, wall: float) -> dict[str, Any]:
        ops = {op: {"calls": self.calls[op], "blocks": self.blocks[op], "seconds": round(self.seconds[op], 3),
                    "ns_per_block": round(self.seconds[op] / self.blocks[op] * 1e9, 1) if self.blocks[op] else None}
               for op in OPS}
        ops["take"]["from_front_stack"] = self.from_stack
        share = sum(self.seconds.values()) / wall if wall else 0.0
        return {"wall_s": round(wall, 2), "pool_share": round(share, 3), "ops": ops,
                "steps": {"general": self.steps["general"], "quiet": self.steps["quiet"]}}


def main(argv: list[str]) -> int:
    meter = Meter()
    meter.install()
    with tempfile.TemporaryDirectory() as tmp:
        args = ["run", *argv, "--no-plots"]
        if "--out" not in argv and "-o" not in argv:
            args += ["--out", f"{tmp}/run"]
        t = time.perf_counter()
        try:
            app(args)
        except SystemExit as e:  # (click ends every run this way; a refused one once kvsim said why)
            if e.code:
                return e.code if isinstance(e.code, int) else 1
        wall = time.perf_counter() - t
    row = meter.report(wall)
    print(f"\n{'operation':<10}{'calls':>10}{'blocks':>13}{'seconds':>10}{'ns a block':>12}")
    for op in OPS:
        r = row["ops"][op]
        per = "-" if r["ns_per_block"] is None else f"{r['ns_per_block']:.1f}"
        print(f"{op:<10}{r['calls']:>10,}{r['blocks']:>13,}{r['seconds']:>10.2f}{per:>12}")
    print(f"taken off the front stack: {meter.from_stack:,}; steps: {row['steps']['general']:,} general, "
          f"{row['steps']['quiet']:,} quiet; the pool: {row['pool_share']:.0%} of {wall:.2f} s")
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
