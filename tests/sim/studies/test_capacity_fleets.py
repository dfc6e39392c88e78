"""`kvsim capacity` on a fixed fleet: the highest rate a cluster of N replicas behind a router, or a
P/D cluster, sustains under TTFT and TPOT targets (DistServe's goodput, per GPU: every replica's
GPUs). The search is sim/studies/capacity.py's; each probe is checked against a plain run of the
same fleet at that load."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvsim.sim.api import sweep_point
from kvsim.sim.cli.app import app
from kvsim.sim.cluster.pd import simulate_pd
from kvsim.sim.cluster.run import simulate_cluster
from kvsim.sim.engine.config import SimConfig
from kvsim.sim.studies.capacity import capacity
from kvsim.sim.studies.sweep import WorkloadSpec
from kvsim.workloads.traces import load_workload

runner = CliRunner()


@pytest.fixture(scope="module")
def trace(golden_head) -> Path:
    return golden_head("shared-prefix.jsonl", 32, "sp32.jsonl")


def test_gpus_count_every_replica():
    assert SimConfig(tensor_parallel=2).num_gpus() == 2
    assert SimConfig(tensor_parallel=2, replicas=3).num_gpus() == 6
    assert SimConfig(tensor_parallel=2, prefill_replicas=1, decode_replicas=3).num_gpus() == 8


@pytest.mark.parametrize("fleet", [{"replicas": 2, "router": "session-affinity"},
                                   {"prefill_replicas": 1, "decode_replicas": 1, "pd_decider": "always"}])
def test_each_probe_is_the_fleets_own_run(trace: Path, fleet: dict):
    cfg = SimConfig(num_gpu_blocks=40, max_num_batched_tokens=256, **fleet).validate()
    c = capacity(WorkloadSpec(path=str(trace)), cfg, slo_ttft=0.05, slo_tpot=0.01, attainment=0.9,
                 tolerance=0.25, point=sweep_point)
    assert c.gpus == 2 and c.best is not None and c.above is not None and c.best.load < c.above.load
    for p in (c.best, c.above):
        run_cfg = cfg.replace(load=p.load, slo_ttft=0.05, slo_tpot=0.01)
        wl = load_workload(trace)
        if "replicas" in fleet:
            got = simulate_cluster(wl, run_cfg).summary["cluster"]["overall"]["slo_attainment"]
        else:
            got = simulate_pd(wl, run_cfg).summary["pd"]["slo_attainment"]
        assert p.attainment == got
        assert p.meets is (got >= 0.9)
    assert c.rate_per_gpu == c.rate_rps / 2


def test_kvsim_capacity_on_a_fixed_cluster(trace: Path):
    r = runner.invoke(app, ["capacity", str(trace), "--slo-ttft", "0.05", "--slo-tpot", "0.01", "--replicas", "2",
                            "--router", "session-affinity", "--num-gpu-blocks", "40", "--tolerance", "0.25", "-w", "1"])
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"capacity of {trace}: 2 replicas behind session-affinity of llama-3-8b on h100-sxm "
                               "x1, 40 blocks each, eviction lru")
    assert "GPUs) with" in lines[-2] and "per GPU, 2 GPUs" in lines[-2]
    # a cache the GPU's memory sizes is named with its size, not "derived"
    r = runner.invoke(app, ["capacity", str(trace), "--slo-ttft", "0.05", "--slo-tpot", "0.01", "--replicas", "2",
                            "--router", "session-affinity", "--tolerance", "0.5", "-w", "1"])
    assert r.stdout.splitlines()[0].startswith(f"capacity of {trace}: 2 replicas behind session-affinity of "
                                               "llama-3-8b on h100-sxm x1, 27,816 blocks each (from the GPU's memory), ")


def test_kvsim_capacity_on_pools_apart_counts_each_pools_gpus(trace: Path):
    r = runner.invoke(app, ["capacity", str(trace), "--slo-ttft", "0.05", "--slo-tpot", "0.01", "--prefill-replicas",
                            "1", "--decode-replicas", "2", "--decode-pool", "tensor_parallel=2", "--num-gpu-blocks",
                            "40", "--tolerance", "0.5", "-w", "1"])
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"capacity of {trace}: 1 prefill (h100-sxm x1, 40 blocks) + 2 decode (h100-sxm x2, "
                               "40 blocks) replicas (decider always) of llama-3-8b, eviction lru")
    assert "per GPU, 5 GPUs" in lines[-2]
