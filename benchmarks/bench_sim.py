"""Benchmark: the simulator's speed targets (issue 18), each as the CLI runs it.

    python benchmarks/bench_sim.py [--only azure|mooncake|tiled|curve|hybrid|cluster|record-ops|pd|routers|offload] [--runs 3] [--traces DIR]

- `kvsim run` of the Azure 2023 conversation trace, Llama-3-70B TP2 on A100,
  block 16, 1,643 blocks, 8,192-token budget, 256 sequences: target <= 5 s;
- `kvsim run` of the whole Mooncake conversation trace with its defaults:
  target <= 15 s;
- the Azure case on the trace tiled ten times (each copy's arrivals shifted
  past the one before): target <= 11x the Azure case's time, peak memory <= 500 MB.

With `--only curve`, issue 4's 10-capacity `kvsim curve` on the Mooncake trace with two
workers (target <= 120 s) instead. With `--only hybrid`, issue 37's: `kvsim run` of the Mooncake
trace on gpt-oss-20b and on gemma-3-27b in vLLM's hybrid KV-cache groups against the same run in
one group (`--disable-hybrid-kv-cache-manager`: the dense model of the same size), alternated run by
run: target <= 2x, the ratio of the medians. With `--only cluster`, issue 38's: 64 replicas
(round-robin) on the Azure trace tiled 8 times with `--load 8` against 8 replicas on the trace
(the Azure case's knobs, `--no-plots`), alternated run by run: target <= 9x, the ratio of the
medians, each with its peak memory. With `--only record-ops`, issue 38's other: the Azure case
with `--record-ops` against the same run without (`--no-plots`), alternated run by run: targets
<= 1.5x the wall time and <= 2x the CPU time (the op writer's child process included), the ratios
of the medians. With `--only pd`, issue 39's: a P/D cluster (2 prefill + 2 decode replicas,
round-robin, every request disaggregated) against 4 aggregated replicas on the first 2,000 Mooncake
conversation requests (Llama-3-8B on H100, `--no-plots`), alternated run by run: target <= 1x per
simulated request, the ratio of the median CPU times per user request and per engine request (a
disaggregated request runs as two: its prefill request and its decode request). With `--only
routers`, no target: the Azure case's 8 replicas in one process (`--workers 1`, `--no-plots`) behind
each router that reads the replicas, which run on one clock, against round-robin (run apart),
alternated run by run: each router's median wall and its ratio to round-robin's. With `--only
offload`, no target: the whole Mooncake conversation trace with a 20 GiB host tier
(`--kv-offloading-size 20`, KV offloading) against the same run without (`--no-plots`), alternated.

Every `kvsim run` runs kvsim's default scheduler, async as `vllm serve` 0.33's (since 2026-11-27),
or with `--sync` vLLM's step-by-step one (`--no-async-scheduling`), in which the figures before
that date were taken (a P/D cluster, and the aggregated cluster it is set against, ran sync until
the P/D cluster ran async too, the day after).

Each case is the median of `--runs` whole processes (the tiled case runs once
unless asked for more); peak memory is the child's own maximum resident set.
Prints one JSON line per case, with the commit measured.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
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
CLUSTER_TILES = 8  # the cluster case: copies of the trace, and replicas (and rate) over the 8-replica run
CAPACITIES = "1000,2000,5000,10000,20000,30000,50000,70000,100000,150000"
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


MODE: list[str] = []  # what `--sync` adds to every `kvsim run`: ["--no-async-scheduling"]


def measure(argv: list[str]) -> tuple[float, float, float]:
    """Wall seconds, peak resident MB and CPU seconds (user + system, its waited-for children
    included) of one whole `kvsim` process (a `run` in `MODE`)."""
    if argv[0] == "run":
        argv = [*argv, *MODE]
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "kvsim", *argv],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status):
        sys.exit(f"kvsim {' '.join(argv)} failed:\n{err}")
    return wall, usage.ru_maxrss / 1024, usage.ru_utime + usage.ru_stime


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
    ap.add_argument("--only", choices=["azure", "mooncake", "tiled", "curve", "hybrid", "cluster", "record-ops", "pd",
                                       "routers", "offload"])
    ap.add_argument("--runs", type=int, default=3, help="whole-process runs per case (median reported)")
    ap.add_argument("--tiled-runs", type=int, default=1)
    ap.add_argument("--traces", type=Path, default=TRACES)
    ap.add_argument("--no-plots", action="store_true", help="pass --no-plots (the default command writes plots)")
    ap.add_argument("--sync", action="store_true",
                    help="every `kvsim run` with --no-async-scheduling (vLLM's step-by-step Scheduler; kvsim's "
                         "default before 2026-11-27, when the figures in docs/benchmarks.md up to then were taken)")
    args = ap.parse_args()
    MODE[:] = ["--no-async-scheduling"] if args.sync else []
    azure = args.traces / "azure2023/AzureLLMInferenceTrace_conv.csv"
    mooncake = args.traces / "mooncake/conversation_trace.jsonl"
    plots = ["--no-plots"] if args.no_plots else []
    sha = commit()
    if args.only == "hybrid":
        return hybrid(mooncake, plots, args.runs, sha)
    if args.only == "cluster":
        return cluster(azure, args.runs, sha)
    if args.only == "record-ops":
        return record_ops(azure, args.runs, sha)
    if args.only == "pd":
        return pd(mooncake, args.runs, sha)
    if args.only == "routers":
        return routers(azure, args.runs, sha)
    if args.only == "offload":
        return offload(mooncake, args.runs, sha)
    wall_of: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tiled = tmp / "azure_x10.csv"
        # case: (command line, target, met(wall, peak), requests simulated)
        cases = {
            "azure": (["run", str(azure), *AZURE_KNOBS, *plots], "wall_s <= 5",
                      lambda w, p: w <= 5, None),
            "mooncake": (["run", str(mooncake), *plots], "wall_s <= 15", lambda w, p: w <= 15, None),
            "tiled": (["run", str(tiled), *AZURE_KNOBS, *plots], "wall_s <= 11 x azure, peak_mb <= 500",
                      lambda w, p: w <= 11 * wall_of["azure"] and p <= 500, None),
            "curve": (["curve", str(mooncake), "--capacities", CAPACITIES, "--workers", "2"], "wall_s <= 120",
                      lambda w, p: w <= 120, 10 * 12031),
        }
        wanted = [args.only] if args.only else ["azure", "mooncake", "tiled"]
        if "tiled" in wanted and "azure" not in wanted:
            wanted.insert(0, "azure")  # the tiled target is relative to it
        for name in wanted:
            argv, target, met, requests = cases[name]
            if name == "tiled":
                tile_azure(azure, tiled, TILES)
            runs = args.tiled_runs if name == "tiled" else args.runs
            walls, peaks = [], []
            for i in range(runs):
                wall, peak, _ = measure([*argv, "--out", str(tmp / f"{name}-{i}")])
                walls.append(wall)
                peaks.append(peak)
            wall, peak = statistics.median(walls), max(peaks)
            wall_of[name] = wall
            if requests is None:
                requests = json.loads((tmp / f"{name}-0/summary.json").read_text())["requests"]
            row = {
                "case": name, "commit": sha, "command": " ".join(["kvsim", *argv, *MODE]), "runs": runs,
                "wall_s": round(wall, 2), "walls_s": [round(w, 2) for w in walls], "peak_mb": round(peak),
                "simulated_requests_per_wall_s": round(requests / wall), "target": target,
                "met": met(wall, peak),
            }
            if name == "tiled":
                row["x_azure"] = round(wall / wall_of["azure"], 2)
            print(json.dumps(row), flush=True)


def hybrid(mooncake: Path, plots: list[str], runs: int, sha: str) -> None:
    """Issue 37's target: a model in hybrid groups at most 2x its run in one group, on Mooncake."""
    with tempfile.TemporaryDirectory() as tmp:
        for model in ("gpt-oss-20b", "gemma-3-27b"):
            argv = ["run", str(mooncake), "--model", model, *plots]
            walls: dict[str, list[float]] = {"hybrid": [], "one group": []}
            for i in range(runs):  # alternated, so a drift in the machine's speed hits both
                walls["hybrid"].append(measure([*argv, "--out", f"{tmp}/h{i}"])[0])
                walls["one group"].append(measure([*argv, "--disable-hybrid-kv-cache-manager", "--out", f"{tmp}/d{i}"])[0])
            ratio = statistics.median(walls["hybrid"]) / statistics.median(walls["one group"])
            print(json.dumps({"case": f"hybrid {model}", "commit": sha, "command": " ".join(["kvsim", *argv, *MODE]),
                              "runs": runs, "walls_s": {k: [round(w, 2) for w in v] for k, v in walls.items()},
                              "x_one_group": round(ratio, 2), "target": "x_one_group <= 2", "met": ratio <= 2}),
                  flush=True)


def alternated(argv: dict[str, list[str]], runs: int, tmp: str) -> tuple[dict[str, list[float]], ...]:
    """Each named command line `runs` times, alternated run by run (so a drift in the machine's speed
    hits all alike), each into its own run folder under `tmp`: (walls, peaks, CPU seconds) by name."""
    walls: dict[str, list[float]] = {k: [] for k in argv}
    peaks: dict[str, list[float]] = {k: [] for k in argv}
    cpus: dict[str, list[float]] = {k: [] for k in argv}
    for i in range(runs):
        for j, (name, args) in enumerate(argv.items()):
            wall, peak, cpu = measure([*args, "--out", f"{tmp}/{j}-{i}"])
            walls[name].append(wall)
            peaks[name].append(peak)
            cpus[name].append(cpu)
    return walls, peaks, cpus


PD_REQUESTS = 2000  # the first requests of the Mooncake conversation trace the P/D case runs


def pd(mooncake: Path, runs: int, sha: str) -> None:
    """Issue 39's target: a P/D cluster costs no more per simulated request than an aggregated one of
    the same size (4 replicas), CPU time of whole processes, alternated run by run."""
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "mooncake.jsonl"
        with open(mooncake) as src, open(trace, "w") as dst:
            dst.writelines(itertools.islice(src, PD_REQUESTS))
        common = ["run", str(trace), "--no-plots", "--router", "round-robin"]
        argv = {"P/D 2+2": [*common, "--prefill-replicas", "2", "--decode-replicas", "2", "--pd-decider", "always"],
                "aggregated 4": [*common, "--replicas", "4"]}
        walls, _, cpus = alternated(argv, runs, tmp)
        per_user = statistics.median(cpus["P/D 2+2"]) / statistics.median(cpus["aggregated 4"])
        print(json.dumps({"case": "pd", "commit": sha, "commands": {k: " ".join(["kvsim", *v, *MODE]) for k, v in argv.items()},
                          "runs": runs, "cpus_s": {k: [round(c, 2) for c in v] for k, v in cpus.items()},
                          "walls_s": {k: [round(w, 2) for w in v] for k, v in walls.items()},
                          "x_aggregated_per_user_request": round(per_user, 2),
                          "x_aggregated_per_engine_request": round(per_user / 2, 2),
                          "target": "<= 1 per simulated request", "met_per_user_request": per_user <= 1,
                          "met_per_engine_request": per_user / 2 <= 1}), flush=True)


def cluster(azure: Path, runs: int, sha: str) -> None:
    """Issue 38's target: 64 replicas on the Azure trace tiled 8x at 8x the rate, at most 9x the
    8-replica run of the trace (each replica sees the same rate: the cost should grow linearly)."""
    knobs = [*AZURE_KNOBS, "--no-plots", "--router", "round-robin"]
    with tempfile.TemporaryDirectory() as tmp:
        tiled = Path(tmp) / f"azure_x{CLUSTER_TILES}.csv"
        tile_azure(azure, tiled, CLUSTER_TILES)
        argv = {"8 replicas": ["run", str(azure), *knobs, "--replicas", "8"],
                "64 replicas": ["run", str(tiled), *knobs, "--replicas", "64", "--load", str(CLUSTER_TILES)]}
        walls, peaks, cpus = alternated(argv, runs, tmp)
        ratio = statistics.median(walls["64 replicas"]) / statistics.median(walls["8 replicas"])
        # (CPU seconds too: on a shared machine they move less than the walls)
        cpu_ratio = statistics.median(cpus["64 replicas"]) / statistics.median(cpus["8 replicas"])
        print(json.dumps({"case": "cluster", "commit": sha,
                          "commands": {k: " ".join(["kvsim", *v, *MODE]) for k, v in argv.items()}, "runs": runs,
                          "walls_s": {k: [round(w, 2) for w in v] for k, v in walls.items()},
                          "cpus_s": {k: [round(c, 2) for c in v] for k, v in cpus.items()},
                          "peak_mb": {k: round(max(v)) for k, v in peaks.items()}, "x_8_replicas": round(ratio, 2),
                          "x_8_replicas_cpu": round(cpu_ratio, 2), "target": "x_8_replicas <= 9", "met": ratio <= 9}),
              flush=True)


ROUTERS = ("round-robin", "least-outstanding", "vllm-dp", "sglang-cache-aware", "llm-d", "llm-d-precise", "dynamo")


def routers(azure: Path, runs: int, sha: str) -> None:
    """No target: what each router that reads the replicas costs, its 8 replicas on one clock in one
    process, against round-robin's replicas run apart in that process (the Azure case's knobs)."""
    common = ["run", str(azure), *AZURE_KNOBS, "--no-plots", "--replicas", "8", "--workers", "1"]
    with tempfile.TemporaryDirectory() as tmp:
        walls, peaks, cpus = alternated({r: [*common, "--router", r] for r in ROUTERS}, runs, tmp)
    base = statistics.median(walls["round-robin"])
    print(json.dumps({"case": "routers", "commit": sha, "command": " ".join(["kvsim", *common, "--router", "R", *MODE]),
                      "runs": runs, "walls_s": {k: [round(w, 2) for w in v] for k, v in walls.items()},
                      "cpus_s": {k: [round(c, 2) for c in v] for k, v in cpus.items()},
                      "peak_mb": {k: round(max(v)) for k, v in peaks.items()},
                      "x_round_robin": {k: round(statistics.median(v) / base, 2) for k, v in walls.items()},
                      "target": None}), flush=True)


OFFLOAD_GIB = "20"  # the offload case's host tier


def offload(mooncake: Path, runs: int, sha: str) -> None:
    """No target: what a host tier costs (`--kv-offloading-size`, with which the scheduler's speed
    shortcuts are off), the whole Mooncake trace with it against without, alternated."""
    common = ["run", str(mooncake), "--no-plots"]
    argv = {"offload": [*common, "--kv-offloading-size", OFFLOAD_GIB], "plain": common}
    with tempfile.TemporaryDirectory() as tmp:
        walls, peaks, cpus = alternated(argv, runs, tmp)
    ratio = statistics.median(walls["offload"]) / statistics.median(walls["plain"])
    print(json.dumps({"case": "offload", "commit": sha, "commands": {k: " ".join(["kvsim", *v, *MODE]) for k, v in argv.items()},
                      "runs": runs, "walls_s": {k: [round(w, 2) for w in v] for k, v in walls.items()},
                      "cpus_s": {k: [round(c, 2) for c in v] for k, v in cpus.items()},
                      "peak_mb": {k: round(max(v)) for k, v in peaks.items()}, "x_plain": round(ratio, 2),
                      "target": None}), flush=True)


def record_ops(azure: Path, runs: int, sha: str) -> None:
    """Issue 38's target: `kvsim run --record-ops` of the Azure case at most 1.5x a plain run's wall
    time and 2x its CPU time (the op writer's child included), the runs alternated."""
    argv = ["run", str(azure), *AZURE_KNOBS, "--no-plots"]
    figures: dict[str, dict[str, list[float]]] = {k: {"wall": [], "cpu": []} for k in ("record-ops", "plain")}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(runs):  # alternated, so a drift in the machine's speed hits both
            for name, extra in (("record-ops", ["--record-ops"]), ("plain", [])):
                wall, _, cpu = measure([*argv, *extra, "--out", f"{tmp}/{name}-{i}"])
                figures[name]["wall"].append(wall)
                figures[name]["cpu"].append(cpu)
    ratio = {k: statistics.median(figures["record-ops"][k]) / statistics.median(figures["plain"][k]) for k in ("wall", "cpu")}
    print(json.dumps({"case": "record-ops", "commit": sha, "command": " ".join(["kvsim", *argv, *MODE, "[--record-ops]"]),
                      "runs": runs, "seconds": {k: {f: [round(x, 2) for x in v] for f, v in d.items()}
                                                for k, d in figures.items()},
                      "x_plain": {k: round(v, 2) for k, v in ratio.items()},
                      "target": "x_plain wall <= 1.5, cpu <= 2", "met": ratio["wall"] <= 1.5 and ratio["cpu"] <= 2}),
          flush=True)


if __name__ == "__main__":
    main()
