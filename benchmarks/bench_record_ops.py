"""Benchmark: `kvsim run --record-ops` against the same run without it, side by side.

    python benchmarks/bench_record_ops.py [--trace PATH] [-n 3] [--head N]

Runs the Azure 2023 conversation trace (Llama-3-70B, TP 2, A100, block 16) with and
without `--record-ops`, alternating, each in a fresh child process, and reports each
run's wall time and peak resident set size (the kernel's own accounting, from wait4),
their medians and the median ratio; then checks that the two runs' steps and requests
tables are identical. Targets (issue 16): <= 1.5x the plain run's wall time, <= 1 GB peak.
`--head N` runs only the trace's first N requests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from child import run_child

TRACE = Path(__file__).resolve().parents[1].parent / "shared/traces/azure2023/AzureLLMInferenceTrace_conv.csv"
FLAGS = ["--model", "llama-3-70b", "--gpu", "a100", "--tp", "2", "--block-size", "16", "--no-plots"]


def run_case(trace: Path, out: Path, record: bool) -> dict:
    """One `kvsim run` in a fresh child: its wall time and peak RSS."""
    cmd = [sys.executable, "-m", "kvsim", "run", str(trace), *FLAGS, "-o", str(out)]
    if record:
        cmd.append("--record-ops")
    _, wall, peak = run_child(cmd)
    return {"wall_s": round(wall, 2), "peak_rss_mb": round(peak, 1)}


def same_tables(a: Path, b: Path) -> bool:
    import pandas as pd

    for name in ("steps.parquet", "requests.parquet"):
        pd.testing.assert_frame_equal(pd.read_parquet(a / name), pd.read_parquet(b / name))
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("-n", "--runs", type=int, default=3)
    ap.add_argument("--head", type=int, default=None, help="only the first N requests")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trace = args.trace
        if args.head is not None:
            trace = Path(tmp) / trace.name
            with open(args.trace) as src, open(trace, "w") as dst:
                dst.writelines(line for i, line in zip(range(args.head + 1), src, strict=False))
        runs: dict[str, list[dict]] = {"plain": [], "record_ops": []}
        for i in range(args.runs):
            for name in runs:
                runs[name].append(run_case(trace, Path(tmp) / f"{name}{i}", name == "record_ops"))
                print(json.dumps({"run": i, "case": name, **runs[name][-1]}), flush=True)
        med = {name: {k: statistics.median(r[k] for r in rs) for k in ("wall_s", "peak_rss_mb")}
               for name, rs in runs.items()}
        ratios = [r["wall_s"] / p["wall_s"] for r, p in zip(runs["record_ops"], runs["plain"], strict=True)]
        ops = Path(tmp) / "record_ops0"
        print(json.dumps({
            "trace": args.trace.name, "head": args.head, "median": med,
            "wall_ratio_median": round(statistics.median(ratios), 3),
            "tables_identical": same_tables(Path(tmp) / "plain0", ops),
            "ops_parquet_mb": round((ops / "ops.parquet").stat().st_size / 2**20, 1),
        }), flush=True)


if __name__ == "__main__":
    main()
