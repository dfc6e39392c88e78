"""Benchmark: verify recorded runs on the CPU with `kvsim gpu-replay --device cpu` (torch kernels).

    python benchmarks/bench_verify.py [--case default] [--case azure-3000] [--out DIR]

Each case records a run (`kvsim run --record-ops`), then verifies it in a fresh child
process and reports ops, steps checked, tokens verified, mismatches, wall time and
the child's peak RSS (the kernel's own accounting, from wait4). Targets (issue 16):
the default run, every step checked, in <= 60 s; a run of >= 1M ops (preemption
and defragmentation on) with 0 mismatches.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from child import run_child

AZURE = Path(__file__).resolve().parents[1].parent / "shared/traces/azure2023/AzureLLMInferenceTrace_conv.csv"

# name -> (workload lines of the Azure conversation trace or None for the default workload, `kvsim run` options)
CASES = {
    "default": (None, []),
    "azure-3000": (3000, ["--num-gpu-blocks", "1500", "--num-cpu-blocks", "1000", "--preemption", "swap",
                          "--defrag-threshold", "32"]),
}


def run_case(name: str, out: Path) -> dict:
    lines, options = CASES[name]
    folder = out / name
    workload = []
    if lines is not None:
        workload = [str(out / f"{name}.csv")]
        with open(AZURE) as src, open(workload[0], "w") as dst:
            for _ in range(lines + 1):  # + the header
                dst.write(src.readline())
    kvsim = [sys.executable, "-m", "kvsim"]
    _, record_s, _ = run_child([*kvsim, "run", *workload, *options, "--record-ops", "--no-plots", "-o", str(folder)])
    report, verify_s, peak = run_child([*kvsim, "gpu-replay", str(folder), "--device", "cpu", "--json"],
                                       ok=(0, 1))  # 1: mismatches, reported below
    rep = json.loads(report)
    return {"case": name, "record_s": round(record_s, 2), "verify_s": round(verify_s, 2),
            "peak_mib": round(peak), "ops": sum(rep["ops"].values()), "ops_by_kind": rep["ops"],
            "steps": rep["steps"], "steps_checked": rep["steps_checked"], "tokens_verified": rep["tokens_verified"],
            "mismatches": rep["mismatches"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", choices=sorted(CASES), help="default: every case")
    ap.add_argument("--out", type=Path, default=Path("runs/bench-verify"), help="run folders go here")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.case or list(CASES):
        print(json.dumps(run_case(name, args.out)), flush=True)


if __name__ == "__main__":
    main()
