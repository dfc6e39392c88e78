"""Benchmark: the simulator's speed targets (issue 18), each as the CLI runs it.

    python benchmarks/bench_sim.py [--only azure|mooncake|tiled] [--runs 3] [--traces DIR]

- `kvsim run` of the Azure 2023 conversation trace, Llama-3-70B TP2 on A100,
  block 16, 1,643 blocks, 8,192-token budget, 256 sequences: target <= 5 s;
- `kvsim run` of the whole Mooncake conversation trace with its defaults:
  target <= 15 s;
- the Azure case on the trace tiled ten times (each copy's arrivals shifted
  past the one before): target <= 11x the Azure case's time, peak memory <= 500 MB.

Each case is the median of `--runs` whole processes (the tiled case runs once
unless asked for more); peak memory is the child's own maximum resident set.
Prints one JSON line per case, with the commit measured.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TRACES = Path(os.environ.get("KVSIM_TRACES", Path(__file__).resolve().parents[2] / "shared/traces"))
AZURE_KNOBS = ["--model", "llama-3-70b", "--tp", "2", "--gpu", "a100-80g", "--block-size", "16",
               "--num-gpu-blocks", "1643", "--max-num-batched-tokens", "8192", "--max-num-seqs", "256"]
TILES = 10
STAMP = "%Y-%m-%d %H:%M:%S"


def tile_azure(src: Path, dst: Path, copies: int) -> int:
    """Write `copies` of the Azure CSV `src` back to back into `dst`, each shifted by the trace's
    span rounded up to whole seconds (plus one); returns the rows written."""
    lines = src.read_text().splitlines()
    header, rows = lines[0], [r for r in lines[1:] if r.strip()]
    first = dt.datetime.strptime(rows[0].split(",")[0][:19], STAMP)
    last = dt.datetime.strptime(rows[-1].split(",")[0][:19], STAMP)
    shift = dt.timedelta(seconds=int((last - first).total_seconds()) + 2)
    with dst.open("w") as f:
        f.write(header + "\n")
        for k in range(copies):
            for row in rows:
                stamp, rest = row.split(",", 1)
                t = dt.datetime.strptime(stamp[:19], STAMP) + k * shift
                f.write(f"{t.strftime(STAMP)}{stamp[19:]},{rest}\n")
    return copies * len(rows)


def measure(argv: list[str]) -> tuple[float, float]:
    """Wall seconds and peak resident MB of one whole `kvsim` process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "sim.cli.app", *argv],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status):
        sys.exit(f"kvsim {' '.join(argv)} failed:\n{err}")
    return wall, usage.ru_maxrss / 1024


def commit() -> str:
    here = Path(__file__).resolve().parents[1]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("+changes" if dirty else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["azure", "mooncake", "tiled"])
    ap.add_argument("--runs", type=int, default=3, help="whole-process runs per case (median reported)")
    ap.add_argument("--tiled-runs", type=int, default=1)
    ap.add_argument("--traces", type=Path, default=TRACES)
    ap.add_argument("--no-plots", action="store_true", help="pass --no-plots (the default command writes plots)")
    args = ap.parse_args()
    azure = args.traces / "azure2023/AzureLLMInferenceTrace_conv.csv"
    mooncake = args.traces / "mooncake/conversation_trace.jsonl"
    sha = commit()
    azure_s = None
    extra = ["--no-plots"] if args.no_plots else []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cases = {
            "azure": ([str(azure), *AZURE_KNOBS], "wall_s <= 5", None),
            "mooncake": ([str(mooncake)], "wall_s <= 15", None),
            "tiled": ([str(tmp / "azure_x10.csv"), *AZURE_KNOBS], "wall_s <= 11 x azure, peak_mb <= 500",
                      TILES),
        }
        wanted = [args.only] if args.only else list(cases)
        if "tiled" in wanted and "azure" not in wanted:
            wanted.insert(0, "azure")  # the tiled target is relative to it
        for name in wanted:
            argv, target, tiles = cases[name]
            if tiles is not None:
                requests = tile_azure(azure, tmp / "azure_x10.csv", tiles)
            runs = args.tiled_runs if tiles is not None else args.runs
            walls, peaks = [], []
            for i in range(runs):
                out = tmp / f"{name}-{i}"
                wall, peak = measure(["run", *argv, "--out", str(out), *extra])
                walls.append(wall)
                peaks.append(peak)
            wall = statistics.median(walls)
            if name == "azure":
                azure_s = wall
                with (tmp / "azure-0/summary.json").open() as f:
                    requests = json.load(f)["requests"]
            elif name == "mooncake":
                with (tmp / "mooncake-0/summary.json").open() as f:
                    requests = json.load(f)["requests"]
            peak = max(peaks)
            if name == "azure":
                met = wall <= 5
            elif name == "mooncake":
                met = wall <= 15
            else:
                met = azure_s is not None and wall <= 11 * azure_s and peak <= 500
            row = {
                "case": name, "commit": sha, "command": " ".join(["kvsim run", *argv, *extra]),
                "runs": runs, "wall_s": round(wall, 2), "walls_s": [round(w, 2) for w in walls],
                "peak_mb": round(peak), "simulated_requests_per_wall_s": round(requests / wall),
                "target": target, "met": met,
            }
            if name == "tiled" and azure_s:
                row["x_azure"] = round(wall / azure_s, 2)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
