"""The text-hashing routers on a shared-prefix workload: six 512-token system prompts, each request
one of them (a seeded draw) plus 64 tokens of its own. llm-d and sglang-cache-aware keep every
group on one replica, so only each group's first request misses; round-robin spreads the groups."""

import random

import pandas.testing as pt
import pytest

from kvsim.sim.cluster.run import simulate_cluster
from kvsim.sim.engine.config import SimConfig
from kvsim.sim.engine.run import simulate
from kvsim.workloads.request import Workload, make_request

CFG = SimConfig(num_gpu_blocks=160, replicas=3)


def groups_workload() -> tuple[Workload, list[int]]:
    rng = random.Random(1)
    reqs, groups = [], []
    for k in range(60):
        g = rng.randrange(6)
        prompt = [g * 10_000 + i for i in range(512)] + [1_000_000 + k * 100 + i for i in range(64)]
        reqs.append(make_request(f"r{k}", k * 0.05, prompt, 16))
        groups.append(g)
    return Workload.from_list(reqs, "groups"), groups


@pytest.fixture(scope="module")
def runs():
    workload, groups = groups_workload()
    return groups, {r: simulate_cluster(workload, CFG.replace(router=r))
                    for r in ("round-robin", "llm-d", "sglang-cache-aware")}


def test_prefix_routers_hit_every_shared_prefix_after_its_first_request(runs):
    groups, by_router = runs
    assert sorted(set(groups)) == [0, 1, 2, 3, 4, 5]
    # 60 prompts of 576 tokens; 54 hit their group's 512-token prefix: 54 x 512 / (60 x 576) = 0.8
    for router in ("llm-d", "sglang-cache-aware"):
        section = by_router[router].summary["cluster"]
        assert section["overall"]["hit_rate"] == 54 * 512 / (60 * 576)
        received = by_router[router].received
        replica_of = dict(zip(received["id"], received["replica"], strict=True))
        placement = {g: {int(replica_of[f"r{k}"]) for k, gk in enumerate(groups) if gk == g} for g in range(6)}
        assert all(len(p) == 1 for p in placement.values())  # each group on one replica
    assert [p["requests"] for p in by_router["llm-d"].summary["cluster"]["per_replica"]] == [15, 24, 21]
    assert [p["requests"] for p in by_router["sglang-cache-aware"].summary["cluster"]["per_replica"]] == [15, 21, 24]
    # round-robin: 1000 blocks of 16 tokens hit (a golden figure) of the 34560 prompt tokens
    assert by_router["round-robin"].summary["cluster"]["overall"]["hit_rate"] == 16000 / 34560


@pytest.mark.parametrize("router", ["llm-d", "sglang-cache-aware"])
def test_each_replica_replays_alone_exactly(runs, router):
    run = runs[1][router]
    for i, replica in enumerate(run.replicas):
        alone = simulate(run.received_workload(i), run.replay_config())
        pt.assert_frame_equal(alone.requests, replica.requests)
        pt.assert_frame_equal(alone.steps, replica.steps)


def test_runs_are_deterministic():
    workload, _ = groups_workload()
    for router in ("llm-d", "sglang-cache-aware"):
        a = simulate_cluster(workload, CFG.replace(router=router))
        b = simulate_cluster(workload, CFG.replace(router=router))
        pt.assert_frame_equal(a.received, b.received)
        assert a.summary == b.summary
