"""Benchmark: the simulator's speed targets (issue 4), each as the CLI runs it.

    python benchmarks/bench_sim.py [--only mooncake|azure|curve] [--traces DIR]

- `kvsim run` of the whole Mooncake conversation trace, Llama-3-8B on H100,
  block size 16: target <= 60 s on one core;
- `kvsim run` of the Azure 2023 conv trace, Llama-3-70B TP2 on A100, block
  size 16: target <= 10 s (about 2,000 simulated requests per wall second);
- a 10-capacity `kvsim curve` on the Mooncake trace: target <= 120 s on two cores.
Each prints wall time, simulated requests per wall second and peak memory.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TRACES = Path(os.environ.get("KVSIM_TRACES", Path(__file__).resolve().parents[2] / "shared/traces"))
CAPACITIES = "1000,2000,5000,10000,20000,30000,50000,70000,100000,150000"


def cases(traces: Path, out: Path) -> dict[str, tuple[list[str], float, int]]:
    mooncake = str(traces / "mooncake/conversation_trace.jsonl")
    azure = str(traces / "azure2023/AzureLLMInferenceTrace_conv.csv")
    return {
        "mooncake": (["run", mooncake, "--model", "llama-3-8b", "--gpu", "h100-sxm", "--block-size", "16",
                      "--out", str(out / "mooncake")], 60.0, 12031),
        "azure": (["run", azure, "--model", "llama-3-70b", "--tp", "2", "--gpu", "a100-80g", "--block-size", "16",
                   "--out", str(out / "azure")], 10.0, 19366),
        "curve": (["curve", mooncake, "--capacities", CAPACITIES, "--workers", "2", "--out", str(out / "curve")],
                  120.0, 10 * 12031),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["mooncake", "azure", "curve"])
    ap.add_argument("--traces", type=Path, default=TRACES)
    args = ap.parse_args()
    kvsim = [sys.executable, "-m", "sim.cli.app"]
    with tempfile.TemporaryDirectory() as tmp:
        for name, (argv, target, requests) in cases(args.traces, Path(tmp)).items():
            if args.only and name != args.only:
                continue
            t0 = time.perf_counter()
            proc = subprocess.run(kvsim + argv, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            if proc.returncode:
                sys.exit(f"{name}: kvsim {' '.join(argv)} failed:\n{proc.stderr}")
            peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
            print(json.dumps({
                "case": name, "command": "kvsim " + " ".join(argv), "wall_s": round(wall, 2),
                "target_s": target, "met": wall <= target,
                "simulated_requests_per_wall_s": round(requests / wall),
                "peak_rss_mb_so_far": round(peak),
            }), flush=True)


if __name__ == "__main__":
    main()
