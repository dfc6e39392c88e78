"""`kvsim capacity --max-replicas`: the fewest replicas behind a router that meet TTFT and TPOT
targets at the workload's rate (sim/studies/capacity.py `fewest_replicas`, `replicas_for_rate`).

The search is checked on hand-made attainment tables (exact probe sequences), then on 48
multi-turn requests at eight times their rate, where session-affinity needs fewer replicas than
round-robin, each answer checked against a plain `simulate_cluster` on both sides of it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvsim.sim.cli.app import app
from kvsim.sim.cluster.run import cluster_point, simulate_cluster
from kvsim.sim.engine.config import ConfigError, SimConfig
from kvsim.sim.studies.capacity import fewest_replicas, replicas_for_rate
from kvsim.sim.studies.sweep import WorkloadSpec
from kvsim.workloads.traces import load_workload

runner = CliRunner()


def _table(attainments: dict[int, float]):
    """An attainment table by replica count; records each round's counts."""
    calls: list[list[int]] = []

    def evaluate(counts: list[int]) -> list[dict]:
        calls.append(list(counts))
        return [{"overall": {"slo_attainment": attainments[n]}} for n in counts]

    return evaluate, calls


STEP = {n: (1.0 if n >= 5 else 0.5) for n in range(1, 17)}  # five replicas needed


def test_the_most_replicas_first_then_bisection():
    evaluate, calls = _table(STEP)
    probes, best, below = fewest_replicas(evaluate, 16, attainment=0.9)
    assert calls == [[16], [8], [4], [6], [5]]
    assert (best.replicas, below.replicas) == (5, 4)
    assert [(p.replicas, p.meets) for p in probes] == [(16, True), (8, True), (4, False), (6, True), (5, True)]


def test_workers_probe_evenly_inside_the_bracket():
    evaluate, calls = _table(STEP)
    _, best, below = fewest_replicas(evaluate, 16, attainment=0.9, workers=3)
    assert calls == [[16], [4, 8, 12], [5, 6, 7]]
    assert (best.replicas, below.replicas) == (5, 4)


def test_one_replica_enough_and_none_enough():
    evaluate, calls = _table(dict.fromkeys(range(1, 5), 0.95))
    _, best, below = fewest_replicas(evaluate, 4, attainment=0.9)
    assert (calls, best.replicas, below) == ([[4], [2], [1]], 1, None)
    evaluate, calls = _table(dict.fromkeys(range(1, 5), 0.5))
    probes, best, below = fewest_replicas(evaluate, 4, attainment=0.9)
    assert (calls, best, below.replicas) == ([[4]], None, 4)


def test_a_miss_above_a_meet_keeps_the_fewest_that_met():
    """Not monotone (3 meets, 4 misses): the answer is the fewest that met, below it the most that missed."""
    evaluate, calls = _table({1: 0.5, 2: 0.5, 3: 0.95, 4: 0.5, 5: 0.95, 6: 0.95, 7: 0.95, 8: 0.95})
    _, best, below = fewest_replicas(evaluate, 8, attainment=0.9)
    assert calls == [[8], [4], [6], [5]]
    assert (best.replicas, below.replicas) == (5, 4)


CFG = SimConfig(num_gpu_blocks=40, max_num_batched_tokens=256, load=8.0)


@pytest.fixture(scope="module")
def trace(golden_head) -> Path:
    return golden_head("multi-turn.jsonl", 48, "mt48.jsonl")


def test_replicas_for_rate_on_a_real_workload(trace: Path):
    spec = WorkloadSpec(path=str(trace))
    got = {r: replicas_for_rate(spec, CFG.replace(router=r), cluster_point, slo_ttft=0.05, slo_tpot=0.01,
                                max_replicas=6, attainment=0.97) for r in ("round-robin", "session-affinity")}
    assert {r: (a.best.replicas, a.below.replicas) for r, a in got.items()} == {
        "round-robin": (3, 2), "session-affinity": (2, 1)}
    assert [p.replicas for p in got["session-affinity"].probes] == [6, 3, 2, 1]
    wl = list(load_workload(trace))
    for r, a in got.items():  # each answer is a plain cluster run's
        for probe in (a.best, a.below):
            run = simulate_cluster(wl, CFG.replace(router=r, replicas=probe.replicas, slo_ttft=0.05, slo_tpot=0.01))
            assert run.summary["cluster"]["overall"]["slo_attainment"] == probe.attainment


def test_replicas_for_rate_checks_its_inputs(trace: Path):
    spec = WorkloadSpec(path=str(trace))
    with pytest.raises(ConfigError, match=r"^max_replicas must be an integer >= 1, got 0$"):
        replicas_for_rate(spec, CFG, cluster_point, slo_ttft=0.05, slo_tpot=0.01, max_replicas=0)
    with pytest.raises(ConfigError, match=r"^slo_tpot must be a positive number of seconds, got -1$"):
        replicas_for_rate(spec, CFG, cluster_point, slo_ttft=0.05, slo_tpot=-1, max_replicas=2)


ARGS = ["--slo-ttft", "0.05", "--slo-tpot", "0.01", "--attainment", "0.97", "--max-replicas", "6",
        "--num-gpu-blocks", "40", "--max-num-batched-tokens", "256", "--load", "8", "-w", "1"]


def test_capacity_max_replicas_per_router(trace: Path):
    r = runner.invoke(app, ["capacity", str(trace), *ARGS, "--router", "round-robin,session-affinity"])
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines() == [
        "replicas for " + str(trace) + " at 34.525 req/s: llama-3-8b on h100-sxm x1, 40 blocks each, eviction lru; "
        "targets TTFT <= 0.05 s and TPOT <= 0.01 s for 97% of requests",
        "  round-robin             6 replicas  100.00% met  meets",
        "  round-robin             3 replicas  100.00% met  meets",
        "  round-robin             2 replicas   93.75% met  misses",
        "  session-affinity        6 replicas  100.00% met  meets",
        "  session-affinity        3 replicas   97.92% met  meets",
        "  session-affinity        2 replicas   97.92% met  meets",
        "  session-affinity        1 replica    75.00% met  misses",
        "round-robin: 3 replicas (3 GPUs), 100.0% of requests within both targets; 2 give 93.8%",
        "session-affinity: 2 replicas (2 GPUs), 97.9% of requests within both targets; 1 gives 75.0%",
    ]
    r = runner.invoke(app, ["capacity", str(trace), *ARGS, "--router", "session-affinity", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["routers"]["session-affinity"] == {
        "replicas": 2, "attainment": 47 / 48, "replicas_below": 1, "attainment_below": 0.75, "max_replicas": 6,
        "probes": [{"replicas": 6, "attainment": 1.0, "meets": True}, {"replicas": 3, "attainment": 47 / 48, "meets": True},
                   {"replicas": 2, "attainment": 47 / 48, "meets": True}, {"replicas": 1, "attainment": 0.75, "meets": False}]}
    assert (round(out["rate_rps"], 3), out["gpus_per_replica"]) == (34.525, 1)


def test_a_scoring_routers_weights_go_to_its_search(trace: Path):
    """`--router-scorers` with `--max-replicas --router llm-d`: checked against llm-d, the search's
    router, not the default round-robin (which weighs no scorers); each router given is checked."""
    r = runner.invoke(app, ["capacity", str(trace), *ARGS, "--router", "llm-d", "--router-scorers", "prefix:1"])
    assert r.exit_code == 1, r.output  # (weighing the prefix alone piles the sessions on too few replicas)
    assert r.stdout.splitlines()[-1] == "llm-d: more than 6 replicas; 6 meet the targets for only 95.8% of requests"
    r = runner.invoke(app, ["capacity", str(trace), *ARGS, "--router", "llm-d,round-robin", "--router-scorers",
                            "prefix:1"])
    assert (r.exit_code, r.stderr) == (2, "error: router_scorers: router round-robin weighs no scorers (those that "
                                          "do: llm-d, llm-d-precise)\n")


def test_capacity_max_replicas_none_enough_exits_1(trace: Path):
    r = runner.invoke(app, ["capacity", str(trace), "--slo-ttft", "0.001", "--slo-tpot", "0.01", "--max-replicas", "2",
                            "--num-gpu-blocks", "40", "-w", "1"])
    assert r.exit_code == 1
    assert r.stdout.splitlines()[-1] == "round-robin: more than 2 replicas; 2 meet the targets for only 0.0% of requests"


@pytest.mark.parametrize(("args", "want"), [
    (["--max-replicas", "0"], "error: --max-replicas must be >= 1, got 0"),
    (["--max-replicas", "4", "--replicas", "2"], "error: --max-replicas searches the replicas: give no --replicas"),
    (["--max-replicas", "4", "--router", "round-robin,nope"],
     "error: router must be one of round-robin, random, least-outstanding, vllm-dp, vllm-dp-legacy, "
     "session-affinity, llm-d-precise, dynamo, llm-d, sglang-cache-aware, got 'nope'"),
])
def test_capacity_replica_errors_are_one_line(trace: Path, args: list[str], want: str):
    r = runner.invoke(app, ["capacity", str(trace), "--slo-ttft", "0.05", "--slo-tpot", "0.01", *args])
    assert (r.exit_code, r.output.strip().splitlines()) == (2, [want])
