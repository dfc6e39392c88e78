"""A cluster run folder read back: a replica's received requests, rebuilt from the folder and the
workload, replay alone to the replica's own tables (what `kvsim conform --cluster-run` compares
with vLLM is the run the replica ran), and the folder's errors name what was given."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pandas.testing as pt
import pytest

from kvsim.sim.cluster.run import simulate_cluster
from kvsim.sim.engine.config import ROUTER_NAMES, SimConfig
from kvsim.sim.engine.run import simulate
from kvsim.sim.studies.cluster_folder import (
    cluster_section,
    is_cluster_folder,
    load_received,
    replica_config,
    write_cluster,
)
from kvsim.workloads.request import Workload, make_request
from kvsim.workloads.traces import load_workload

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "workloads"
CFG = SimConfig(num_gpu_blocks=40, max_num_batched_tokens=256, replicas=3, load=4.0)


@pytest.fixture(scope="module")
def workload() -> Workload:
    return Workload.from_list(list(load_workload(GOLDEN / "multi-turn.jsonl"))[:48], "mt48")


@pytest.mark.parametrize("router", ROUTER_NAMES)
def test_a_replica_read_from_its_folder_replays_its_run(workload: Workload, tmp_path: Path, router: str):
    run = simulate_cluster(workload, CFG.replace(router=router))
    write_cluster(run, tmp_path, plots=False)
    assert is_cluster_folder(tmp_path) and not is_cluster_folder(tmp_path / "replica-0")
    for i in range(3):
        cfg = replica_config(tmp_path, i)
        assert (cfg.replicas, cfg.load, cfg.num_gpu_blocks, cfg.router) == (1, 1.0, 40, router)
        received = load_received(tmp_path, i, workload)
        assert received.name == f"mt48-replica-{i}"
        alone = simulate(received, cfg)
        recorded = pd.read_parquet(tmp_path / f"replica-{i}" / "requests.parquet")
        pt.assert_frame_equal(alone.requests, recorded)
        assert [r.think_time for r in received] == [None] * len(recorded)


def test_folder_errors_name_what_was_given(workload: Workload, tmp_path: Path):
    run = simulate_cluster(workload, CFG.replace(router="round-robin"))
    write_cluster(run, tmp_path / "c", plots=False)
    assert [f["requests"] for f in cluster_section(tmp_path / "c")["per_replica"]] == [16, 16, 16]
    with pytest.raises(ValueError, match=r"^--replica -1: .*/c has 3 replicas \(0 to 2\)$"):
        replica_config(tmp_path / "c", -1)
    with pytest.raises(FileNotFoundError, match=r"/c/replica-1: not a cluster run folder \(no received.parquet"):
        cluster_section(tmp_path / "c" / "replica-1")
    shorter = Workload.from_list([r for r in workload if r.id != "mt-0-2"], "short")
    with pytest.raises(ValueError, match=r"^request 'mt-0-2', which replica \d received, is not in short: give"):
        for i in range(3):
            load_received(tmp_path / "c", i, shorter)
    other = Workload.from_list([r if r.id != "mt-0-0" else make_request("mt-0-0", 0.0, list(range(7)), 39, session="mt-0")
                                for r in workload], "other")
    with pytest.raises(ValueError, match=r"^request 'mt-0-0' has a 7-token prompt in other but 101 in .*/c: not the"):
        for i in range(3):
            load_received(tmp_path / "c", i, other)
