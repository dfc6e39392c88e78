"""Benchmark: how fast the command line answers (issue 15, part 1).

    python benchmarks/bench_cli.py [--runs 5] [--requests 600] [--trace PATH | --workload FILE]

- `kvsim --help` and `kvsim cache-replay --help`, each a whole process:
  target <= 0.25 s (median of the runs);
- a whole `kvsim cache-replay` process on the first 600 requests of the
  Mooncake conversation trace against the time vLLM 0.33's own KVCacheManager
  takes to replay them under the same loop (sim.conform.vllm_cache, import
  not counted; also given as a whole process, imports counted): target kvsim
  <= 1/3 of vLLM. Needs vLLM (CPU-only is enough);
  without it that part is skipped and says so. Hit tokens must agree.
  `--workload FILE` replays that file (any format) whole instead, e.g. one
  from `kvsim workload generate multi-turn -n 600`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TRACE = Path(__file__).resolve().parents[2] / "shared/traces/mooncake/conversation_trace.jsonl"
KVSIM = [sys.executable, "-m", "kvsim"]


def timed(cmd: list[str], runs: int) -> tuple[float, str]:
    """Median wall seconds of `runs` whole-process runs (after one warm-up), and the last stdout."""
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def vllm_replay_seconds(path: Path, block_size: int, num_blocks: int) -> tuple[float, int] | None:
    """vLLM's replay time of the workload (seconds, import excluded) and its hit tokens; None without vLLM."""
    from kvsim.sim.conform.vllm_setup import vllm_available
    if vllm_available() is not None:  # it returns the reason vLLM cannot be used
        return None
    import vllm.v1.core.kv_cache_manager  # noqa: F401  (imported before the clock starts)

    import kvsim.sim.conform.vllm_cache as vc
    from kvsim.workloads.traces import load_workload

    reqs = list(load_workload(path))
    t0 = time.perf_counter()
    records = vc.replay_manager(reqs, block_size=block_size, num_blocks=num_blocks)
    return time.perf_counter() - t0, sum(r["hit_tokens"] for r in records)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--workload", type=Path, help="replay this file whole instead of the trace's head")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=10_000)
    ap.add_argument("--vllm-child", type=Path, help=argparse.SUPPRESS)  # one whole vLLM process
    args = ap.parse_args()
    if args.vllm_child is not None:
        print(json.dumps(vllm_replay_seconds(args.vllm_child, args.block_size, args.num_blocks)))
        return

    report: dict[str, object] = {}
    for name, cmd in (("help_s", ["--help"]), ("cache_replay_help_s", ["cache-replay", "--help"])):
        report[name] = round(timed(KVSIM + cmd, args.runs)[0], 3)

    with tempfile.TemporaryDirectory() as tmp:
        head = args.workload
        if head is None:
            head = Path(tmp) / f"mooncake_{args.requests}.jsonl"
            with open(args.trace) as src, open(head, "w") as dst:
                dst.writelines(itertools.islice(src, args.requests))
        cmd = KVSIM + ["cache-replay", str(head), "--json",
                       "-b", str(args.block_size), "-n", str(args.num_blocks)]
        kvsim_s, out = timed(cmd, args.runs)
        summary = json.loads(out)
        report.update(requests=summary["requests"], kvsim_process_s=round(kvsim_s, 3),
                      hit_tokens=summary["hit_tokens"])
        ref = vllm_replay_seconds(head, args.block_size, args.num_blocks)
        if ref is not None:
            child = [sys.executable, __file__, "--vllm-child", str(head),
                     "--block-size", str(args.block_size), "--num-blocks", str(args.num_blocks)]
            report["vllm_process_s"] = round(timed(child, args.runs)[0], 3)
    if ref is None:
        report["vllm"] = "not installed: vLLM comparison skipped"
    else:
        vllm_s, vllm_hits = ref
        report.update(vllm_replay_s=round(vllm_s, 3), vllm_hit_tokens=vllm_hits,
                      kvsim_over_vllm=round(kvsim_s / vllm_s, 3),
                      kvsim_over_vllm_process=round(kvsim_s / report["vllm_process_s"], 3))
        if vllm_hits != summary["hit_tokens"]:
            report["MISMATCH"] = "hit tokens differ between kvsim and vLLM"
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
