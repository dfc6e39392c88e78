"""A cluster's replicas against vLLM (issue 38, section 5): each replica's received requests, at
the times they reached it and under the run's config, conform to vLLM 0.33 in `kvsim conform`'s
default mode, for every router.

The trace is the first 48 requests of the multi-turn golden trace (closed-loop sessions, so a
turn is routed when released) at four times its rate over 3 replicas of 40 blocks: every replica
evicts, and some preempt. The run folder comes from `kvsim run --replicas 3`, and each replica
goes through `kvsim conform --cluster-run FOLDER --replica I`, the path a user takes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvsim.sim.cli.app import app
from kvsim.sim.engine.config import ROUTER_NAMES

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "workloads"
RUN = ["--replicas", "3", "--num-gpu-blocks", "40", "--max-num-batched-tokens", "256", "--load", "4", "--no-plots"]
needs_vllm = pytest.mark.needs_vllm
runner = CliRunner()


@pytest.fixture(scope="module")
def trace(golden_head) -> Path:
    """The multi-turn trace's first 48 requests (in arrival order, so every turn's session is whole)."""
    return golden_head("multi-turn.jsonl", 48, "mt48.jsonl")


def _cluster_run(trace: Path, out: Path, router: str) -> dict:
    r = runner.invoke(app, ["run", str(trace), "--router", router, *RUN, "-o", str(out)])
    assert r.exit_code == 0, r.output
    return json.loads((out / "summary.json").read_text())["cluster"]


@needs_vllm
@pytest.mark.parametrize("router", ROUTER_NAMES)
def test_each_replica_of_a_cluster_conforms_to_vllm(trace: Path, tmp_path: Path, router: str):
    section = _cluster_run(trace, tmp_path / "run", router)
    counts = [f["requests"] for f in section["per_replica"]]
    assert sum(counts) == 48
    evictions = [json.loads((tmp_path / "run" / f"replica-{i}" / "summary.json").read_text())["evictions"]
                 for i in range(3)]
    assert sum(evictions) > 0, evictions  # the cache is under pressure
    for i, n in enumerate(counts):
        r = runner.invoke(app, ["conform", str(trace), "--cluster-run", str(tmp_path / "run"), "--replica", str(i)])
        assert r.exit_code == 0, r.output
        lines = r.stdout.splitlines()
        assert lines[0].startswith(f"kvsim vs vLLM 0.33.0 on replica {i} of {tmp_path / 'run'} "
                                   f"(mt48.jsonl-replica-{i}): {n} requests, llama-3-8b, block size 16, 40 blocks")
        assert lines[1:] == [f"manager   {n} requests, 0 differ", f"scheduler {n} requests, 0 differ", "identical"]


@needs_vllm
def test_a_replica_that_is_not_there_is_one_line(trace: Path, tmp_path: Path):
    """A replica out of range, a workload the run was not made with, a folder that is not a cluster
    run's: each a one-line error naming it."""
    _cluster_run(trace, tmp_path / "run", "round-robin")
    run = tmp_path / "run"
    other = tmp_path / "other.jsonl"
    other.write_text((GOLDEN / "multi-turn.jsonl").read_text().replace('"mt-0-0"', '"x-0-0"'))
    cases = [
        ([str(trace), "--cluster-run", str(run), "--replica", "3"], f"error: --replica 3: {run} has 3 replicas (0 to 2)"),
        ([str(other), "--cluster-run", str(run), "--replica", "0"],
         "error: request 'mt-0-0', which replica 0 received, is not in other.jsonl: give the workload the cluster "
         "run was made with"),
        ([str(trace), "--cluster-run", str(run / "replica-0"), "--replica", "0"],
         f"error: {run / 'replica-0'}: not a cluster run folder (no received.parquet; `kvsim run --replicas N` "
         "writes one)"),
    ]
    for args, want in cases:
        r = runner.invoke(app, ["conform", *args])
        assert r.exit_code == 2
        assert r.output.strip().splitlines() == [want], r.output


def test_cluster_run_errors_are_one_line(trace: Path, tmp_path: Path):
    """Bad --cluster-run input: each a one-line error naming what was given (before vLLM runs)."""
    _cluster_run(trace, tmp_path / "run", "round-robin")
    run = str(tmp_path / "run")
    cases = [
        (["--cluster-run", run], "error: --cluster-run FOLDER and --replica I go together: one replica of a cluster run"),
        (["--replica", "0"], "error: --cluster-run FOLDER and --replica I go together: one replica of a cluster run"),
        (["--cluster-run", run, "--replica", "0", "--num-gpu-blocks", "5"],
         "error: --cluster-run takes the run's config from its folder: give no --num-gpu-blocks"),
        (["--cluster-run", run, "--replica", "0", "--random", "3"],
         "error: --cluster-run and --random are two different cases: give one"),
    ]
    for args, want in cases:
        r = runner.invoke(app, ["conform", *args])
        assert r.exit_code == 2
        assert r.output.strip().splitlines() == [want], r.output
