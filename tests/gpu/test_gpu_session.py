"""benchmarks/gpu_session.sh under QUICK=1 (tiny shapes, Triton's interpreter on the CPU), through
benchmarks/gpu_call.sh: every part a GPU session runs, end to end, so a broken part is found here and not
in a lent machine's minutes."""

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def mooncake_like(path: Path, requests: int = 40, seed: int = 0) -> Path:
    """A small trace in the Mooncake conversation format (a hash id per 512 tokens, a shared first
    block), standing in for the real one the script takes the first lines of."""
    rnd, ids = random.Random(seed), iter(range(1, 10**6))
    with open(path, "w") as f:
        for i in range(requests):
            n = rnd.randint(300, 1500)
            f.write(json.dumps({"timestamp": 250 * i, "input_length": n, "output_length": rnd.randint(3, 40),
                                "hash_ids": [0] + [next(ids) for _ in range((n - 1) // 512)]}) + "\n")
    return path


# the parts in two groups of about equal time (QUICK, one core each: ~45 s)
GROUPS = ("holdout graphs pd mooncake fp8bench", "hybrid fp8 profile")


def test_one_call_runs_every_new_part_in_groups_side_by_side_and_tars_them(tmp_path):
    """benchmarks/gpu_call.sh over benchmarks/gpu_session.sh: `env` once, each group of parts its own
    gpu_session.sh at once, one tarball back; every new part runs to its end (one call for both scripts:
    each part once, where two tests ran mooncake and fp8 twice)."""
    trace = mooncake_like(tmp_path / "mooncake.jsonl")
    out = tmp_path / "out"
    env = {**os.environ, "QUICK": "1", "MOONCAKE": str(trace), "TRITON_INTERPRET": "1", "OUT": str(out),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    r = subprocess.run(["bash", str(ROOT / "benchmarks/gpu_call.sh"), *GROUPS], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    work = out / "w"
    assert f"### {work / 'g1.log'}" in r.stdout and f"### {work / 'g2.log'}" in r.stdout  # each log's tail
    assert "fp8bench took" in r.stdout  # the first group's last part
    listing = subprocess.run(["tar", "tzf", str(out / "all.tgz")], capture_output=True, text=True).stdout.split()
    for name in ("./env/env.json", "./g1.log", "./g1/replay_mooncake_default.json", "./g2/replay_fp8_fp8.json"):
        assert name in listing, name
    log = "".join((work / f"g{i}.log").read_text() for i in (1, 2))
    for part in ("holdout", "graphs", "pd", "mooncake", "hybrid", "fp8", "fp8bench"):
        assert f"{part} took" in log, part
    folder = {part: work / f"g{i}" for i, group in enumerate(GROUPS, 1) for part in group.split()}
    if shutil.which("py-spy", path=env["PATH"]):  # (a dev tool, not a test dependency)
        assert "profile took" in log
        assert (folder["profile"] / "replay_profile_top.txt").read_text().startswith("own time (")
    else:
        assert "profile: no py-spy" in log
    for dtype, name in (("fp8", "float8_e4m3fn"), ("float16", "float16")):
        report = json.loads((folder["fp8"] / f"replay_fp8_{dtype}.json").read_text())
        assert report["mismatches"] == 0 and report["dtype"] == name and report["tokens_verified"] > 0
    kernel = "grouped" if hasattr(torch, "_grouped_mm") else "bmm"  # bfloat16's default
    holdout = json.loads((folder["holdout"] / "holdout_quick.json").read_text())
    assert [row["moe_kernel"] for row in holdout] == [kernel] * 4
    for bench in ("graphs", "pd", "fp8bench"):
        figures = json.loads((folder[bench] / f"bench_{bench}_fp16_b16.json").read_text())["figures"]
        assert figures, bench
    assert json.loads((folder["fp8bench"] / "bench_fp8bench_fp16_b16.json").read_text())["sections"] == ["fp8"]
    for part, replay in (("mooncake", "mooncake_default"), ("hybrid", "hybrid_gpt-oss-20b"),
                         ("hybrid", "hybrid_gemma-3-27b")):
        report = json.loads((folder[part] / f"replay_{replay}.json").read_text())
        assert report["mismatches"] == 0 and report["steps"] == report["steps_checked"] > 0, replay
        assert report["config"]["block_size"] == 16  # a saved report holds its run's config
    assert log.count("mismatches     0") == 5
    mooncake = json.loads((folder["mooncake"] / "replay_mooncake_default.json").read_text())
    assert mooncake["attention_sample"] == 2 and mooncake["check"] == "touched"
