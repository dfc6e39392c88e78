"""A cluster of replicas that differ (`SimConfig.replica_pools`): each group of replicas runs under its
own GPU, TP, blocks and limits, each replica still an exact lone engine under its own config."""

import json
from pathlib import Path

import pandas.testing as pt
import pytest
from typer.testing import CliRunner

from kvsim.sim.api import default_workload
from kvsim.sim.cli.app import app
from kvsim.sim.cluster.run import simulate_cluster
from kvsim.sim.engine.config import ConfigError, SimConfig
from kvsim.sim.engine.run import simulate

POOLS = "1:gpu=a100-80g,tensor_parallel=2,num_gpu_blocks=90;2:num_gpu_blocks=200,max_num_seqs=8"


def test_each_group_runs_under_its_own_config():
    cfg = SimConfig(replicas=3, router="least-outstanding", replica_pools=POOLS)
    assert [(c.gpu, c.tensor_parallel, c.num_gpu_blocks, c.max_num_seqs, c.replica_pools)
            for c in cfg.replica_configs()] == [("a100-80g", 2, 90, None, None), ("h100-sxm", 1, 200, 8, None),
                                                ("h100-sxm", 1, 200, 8, None)]
    assert cfg.num_gpus() == 4
    run = simulate_cluster(default_workload(), cfg)
    assert [int(r.summary["num_gpu_blocks"]) for r in run.replicas] == [90, 200, 200]
    assert [r.config.gpu for r in run.replicas] == ["a100-80g", "h100-sxm", "h100-sxm"]
    for i, replica in enumerate(run.replicas):  # exact: each replays alone under its own config
        alone = simulate(run.received_workload(i), run.replay_config(i))
        pt.assert_frame_equal(alone.requests, replica.requests)
        pt.assert_frame_equal(alone.steps, replica.steps)
    # the A100 pair's steps are priced on an A100 at TP 2: not as the H100s' for the same batch
    assert run.replicas[0].steps["duration"].iloc[0] != run.replicas[1].steps["duration"].iloc[0]


def test_replicas_that_differ_run_apart_as_on_one_clock():
    cfg = SimConfig(replicas=3, router="round-robin", replica_pools=POOLS, closed_loop_sessions=False)
    one = simulate_cluster(default_workload(), cfg, apart=False)
    apart = simulate_cluster(default_workload(), cfg, workers=2)
    assert one.summary == apart.summary
    for x, y in zip(one.replicas, apart.replicas, strict=True):
        pt.assert_frame_equal(x.requests, y.requests)
        pt.assert_frame_equal(x.steps, y.steps)


@pytest.mark.parametrize(("changes", "message"), [
    ({"replica_pools": "2:gpu=a100-80g;2:"}, "replica_pools: its counts sum to 4, but replicas is 3"),
    ({"replica_pools": "3"}, "replica_pools: group 1 '3': expected count:field=value,... with a count >= 1"),
    ({"replica_pools": "0:;3:"}, "replica_pools: group 1 '0:': expected count:field=value"),
    ({"replica_pools": "1:block_size=32;2:"}, "replica_pools group 1: expected field=value with field one of gpu,"),
    ({"replica_pools": "1:gpu=tpu;2:"}, "replica_pools group 1: unknown gpu 'tpu'; choose from a100-80g"),
    ({"replica_pools": "1:", "replicas": 1}, "replica_pools needs an aggregated cluster (replicas > 1)"),
])
def test_bad_pools_are_one_error(changes, message):
    with pytest.raises(ConfigError) as info:
        SimConfig(**{"replicas": 3, **changes}).validate()
    assert message in str(info.value)


def test_llm_d_needs_one_pod_size():
    cfg = SimConfig(replicas=2, router="llm-d", replica_pools="1:num_gpu_blocks=100;1:num_gpu_blocks=120")
    with pytest.raises(ConfigError, match="router llm-d sizes each pod's approximate prefix LRU by one pod's blocks"):
        simulate_cluster(default_workload(), cfg)


def test_cli_replica_pools(tmp_path: Path):
    out = tmp_path / "c"
    r = CliRunner().invoke(app, ["run", "--replicas", "3", "--router", "round-robin", "--replica-pools", POOLS,
                                 "--no-plots", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines()[0] == ("default (300 requests): 3 replicas of llama-3-8b: 1 on a100-80g x2 (90 "
                                        "blocks), 2 on h100-sxm x1 (200 blocks); blocks of 16 tokens, eviction lru, "
                                        "async scheduling")
    assert [line.split(")")[0] + ")" for line in r.stdout.splitlines()[2:5]] == [
        "0 (a100-80g x2, 90 blocks)", "1 (h100-sxm x1, 200 blocks)", "2 (h100-sxm x1, 200 blocks)"]
    configs = [json.loads((out / f"replica-{i}" / "config.json").read_text()) for i in range(3)]
    assert [(c["gpu"], c["tensor_parallel"], c["num_gpu_blocks"]) for c in configs] == [
        ("a100-80g", 2, 90), ("h100-sxm", 1, 200), ("h100-sxm", 1, 200)]
    assert json.loads((out / "config.json").read_text())["replica_pools"] == POOLS
    r = CliRunner().invoke(app, ["run", "--replicas", "3", "--replica-pools", "2:;2:", "-o", str(tmp_path / "x")])
    assert r.exit_code == 2 and r.stderr.count("\n") == 1
    assert "replica_pools: its counts sum to 4, but replicas is 3" in r.stderr
