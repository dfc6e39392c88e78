"""benchmarks/gpu_session.sh under QUICK=1 (tiny shapes, Triton's interpreter on the CPU): every part a
GPU session runs, end to end, so a broken part is found here and not in a lent machine's minutes."""

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


def test_the_session_script_runs_every_new_part(tmp_path):
    trace = mooncake_like(tmp_path / "mooncake.jsonl")
    env = {**os.environ, "QUICK": "1", "MOONCAKE": str(trace), "TRITON_INTERPRET": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    out = tmp_path / "out"
    r = subprocess.run(["bash", str(ROOT / "benchmarks/gpu_session.sh"), str(out), "holdout", "graphs", "pd", "mooncake",
                        "hybrid", "fp8", "fp8bench", "profile"], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for part in ("holdout", "graphs", "pd", "mooncake", "hybrid", "fp8", "fp8bench"):
        assert f"{part} took" in r.stdout, part
    if shutil.which("py-spy", path=env["PATH"]):  # (a dev tool, not a test dependency)
        assert "profile took" in r.stdout and (out / "replay_profile_top.txt").read_text().startswith("own time (")
    else:
        assert "profile: no py-spy" in r.stdout
    for dtype, name in (("fp8", "float8_e4m3fn"), ("float16", "float16")):
        report = json.loads((out / f"replay_fp8_{dtype}.json").read_text())
        assert report["mismatches"] == 0 and report["dtype"] == name and report["tokens_verified"] > 0
    kernel = "grouped" if hasattr(torch, "_grouped_mm") else "bmm"  # bfloat16's default
    assert [row["moe_kernel"] for row in json.loads((out / "holdout_quick.json").read_text())] == [kernel] * 4
    for bench in ("graphs", "pd", "fp8bench"):
        figures = json.loads((out / f"bench_{bench}_fp16_b16.json").read_text())["figures"]
        assert figures, bench
    assert json.loads((out / "bench_fp8bench_fp16_b16.json").read_text())["sections"] == ["fp8"]
    for replay in ("mooncake_default", "hybrid_gpt-oss-20b", "hybrid_gemma-3-27b"):
        report = json.loads((out / f"replay_{replay}.json").read_text())
        assert report["mismatches"] == 0 and report["steps"] == report["steps_checked"] > 0, replay
        assert report["config"]["block_size"] == 16  # a saved report holds its run's config
    assert r.stdout.count("mismatches     0") == 5
    mooncake = json.loads((out / "replay_mooncake_default.json").read_text())
    assert mooncake["attention_sample"] == 2 and mooncake["check"] == "touched"


def test_one_call_runs_groups_side_by_side_and_tars_them(tmp_path):
    """benchmarks/gpu_call.sh: `env` once, each group its own gpu_session.sh at once, one tarball back."""
    trace = mooncake_like(tmp_path / "mooncake.jsonl", requests=8)
    out = tmp_path / "out"
    env = {**os.environ, "QUICK": "1", "MOONCAKE": str(trace), "TRITON_INTERPRET": "1", "OUT": str(out),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    r = subprocess.run(["bash", str(ROOT / "benchmarks/gpu_call.sh"), "mooncake", "fp8"], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "mooncake took" in r.stdout and "fp8 took" in r.stdout
    listing = subprocess.run(["tar", "tzf", str(out / "all.tgz")], capture_output=True, text=True).stdout.split()
    for name in ("./env/env.json", "./g1.log", "./g1/replay_mooncake_default.json", "./g2/replay_fp8_fp8.json"):
        assert name in listing, name
