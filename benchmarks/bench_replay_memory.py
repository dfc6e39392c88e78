"""Benchmark: peak memory of `kvsim cache-replay` over the Mooncake conversation trace.

    python benchmarks/bench_replay_memory.py [--trace PATH] [-k 32 -k 1] [--checkout DIR]

Each case runs the command in a child process and reports that child's peak
resident set size (the kernel's own accounting, from wait4) with its wall time
and summary. Target (issue 15): the whole trace at -k 32 in <= 200 MB, as a
streamed replay holds only the running and preempted requests. `--checkout`
runs another checkout's code instead (from there, first on PYTHONPATH), to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from child import run_child

TRACE = Path(__file__).resolve().parents[1].parent / "shared/traces/mooncake/conversation_trace.jsonl"


def run_case(trace: Path, k: int, checkout: Path | None) -> dict:
    """One `cache-replay -k K --json` in a fresh child: its peak RSS, wall time and summary."""
    env = dict(os.environ)
    if checkout is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(checkout), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "kvsim", "cache-replay", str(trace), "-k", str(k), "--json"]
    # NOTE: `python -m` puts the working folder ahead of PYTHONPATH, so run from the checkout
    out, wall, peak = run_child(cmd, env=env, cwd=checkout)
    return {"max_running": k, "peak_rss_mb": round(peak, 1), "wall_s": round(wall, 2),
            "summary": json.loads(out)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("-k", "--max-running", type=int, action="append", dest="ks")
    ap.add_argument("--checkout", type=Path, default=None, help="run this checkout's code instead")
    args = ap.parse_args()
    for k in args.ks or [32, 1]:
        print(json.dumps({"trace": args.trace.name, **run_case(args.trace, k, args.checkout)}), flush=True)


if __name__ == "__main__":
    main()
