"""`kvsim run` with no arguments: the embedded workload in a cache it fills, so policies differ,
and a summary that says what was simulated, where the files are and what to run next."""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvsim.sim.api import DEFAULT_WORKLOAD_BLOCKS
from kvsim.sim.cli.app import app
from kvsim.sim.engine.config import SimConfig
from kvsim.sim.engine.run import simulate
from kvsim.workloads.default import default_workload

runner = CliRunner()
NAME = "runs/default-llama-3-8b-h100-sxm-tp1-bs16-e2581138"


def _kvsim(command: str) -> str:
    """Run one printed `kvsim ...` command in-process; its stdout."""
    words = shlex.split(command)
    assert words[0] == "kvsim"
    r = runner.invoke(app, words[1:])
    assert r.exit_code == 0, r.output
    return r.stdout


@pytest.fixture(scope="module")
def default_out(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    """`kvsim run` exactly as typed (run folder under ./runs), in a fresh directory."""
    cwd, tmp = os.getcwd(), tmp_path_factory.mktemp("cwd")
    os.chdir(tmp)
    try:
        yield tmp, _kvsim("kvsim run")
    finally:
        os.chdir(cwd)


def test_the_default_run_fills_the_cache_and_evicts(default_out: tuple[Path, str]) -> None:
    tmp, _ = default_out
    s = json.loads((tmp / NAME / "summary.json").read_text())
    assert (s["num_gpu_blocks"], s["requests"], s["finished"]) == (512, 300, 300)
    assert (s["peak_block_usage"], s["evictions"], s["preemptions_recompute"]) == (1.0, 5486, 3)
    assert round(s["hit_rate"], 4) == 0.6475
    assert (s["goodput_rps"], s["slo_attainment"], s["overloaded"]) == (None, None, False)  # no SLO: no goodput


def test_the_summary_says_what_was_simulated_and_what_to_try_next(default_out: tuple[Path, str]) -> None:
    _, out = default_out
    lines = out.splitlines()
    assert lines[0] == ("default (300 requests): llama-3-8b on h100-sxm x1, "
                        "KV cache 512 blocks x 16 tokens = 8,192 tokens, eviction lru, async scheduling")
    assert lines[3].startswith("  cache: 512 blocks, the embedded workload's default")
    assert "27,816 blocks, which this workload never fills" in out
    assert ("64.75% of prompt tokens were prefix-cache hits. The cache filled (100.00% of 512 blocks"
            in out)
    for label in ("hit rate, tokens", "evictions", "preemptions (recompute / swap)",
                  "mean id-space fragmentation (blocks)", "TTFT p50/p90/p99", "offered / served (req/s)"):
        assert any(line.startswith(label) for line in lines), label
    assert lines[lines.index(f"run folder: {NAME}") + 1:][:3] == [
        f"plots:      {NAME}/blocks.png", f"            {NAME}/hit_rate.png",
        f"            {NAME}/latency.png"]
    assert lines[-5:] == [
        "next:",
        "  # the same run under s3fifo, side by side with this one",
        f"  kvsim run --eviction s3fifo -o runs/default-s3fifo && kvsim compare {NAME} runs/default-s3fifo",
        "  # prefix hit rate against cache size, one line per policy (cache replay)",
        "  kvsim workload generate default -o default.jsonl && kvsim curve default.jsonl "
        "-c 128,256,512,1024 -p lru,s3fifo,arc,lfu,fifo",
    ]


def test_the_printed_policy_comparison_runs_and_differs(default_out: tuple[Path, str]) -> None:
    tmp, out = default_out
    rerun, compare = out.splitlines()[-3].strip().split(" && ")
    cwd = os.getcwd()
    os.chdir(tmp)
    try:
        _kvsim(rerun)
        table = _kvsim(compare).splitlines()
    finally:
        os.chdir(cwd)
    assert table[0].split() == [Path(NAME).name, "default-s3fifo"]
    hit = next(line for line in table if line.startswith("hit rate, tokens"))
    assert hit.split()[-2:] == ["64.75%", "67.48%"]  # lru, s3fifo


@pytest.mark.parametrize(("policy", "hit_rate", "evictions"),
                         [("arc", 0.6739, 5212), ("lfu", 0.6581, 5372), ("fifo", 0.5687, 6346)])
def test_the_default_cache_spreads_the_policies(policy: str, hit_rate: float, evictions: int) -> None:
    cfg = SimConfig(num_gpu_blocks=DEFAULT_WORKLOAD_BLOCKS, eviction=policy).validate()
    s = simulate(default_workload(), cfg).summary
    assert (round(s["hit_rate"], 4), s["evictions"]) == (hit_rate, evictions)


def test_a_given_cache_size_or_memory_share_replaces_the_default(tmp_path: Path) -> None:
    r = runner.invoke(app, ["run", "--gpu-memory-utilization", "0.9", "--no-plots", "-o", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert "KV cache 27,816 blocks x 16 tokens = 445,056 tokens" in r.stdout.splitlines()[0]
    assert "  cache: " not in r.stdout and "nothing was evicted, so every eviction policy" in r.stdout
