"""Replicas that never interact run apart (`sim.cluster.parallel`) with exactly the result one clock
gives: every replica's tables, the received requests, the load table and the summary; anything
else (a router that reads the replicas, closed-loop turns, KV events) still runs on one clock."""

from pathlib import Path

import pandas.testing as pt
import pyarrow.parquet as pq
import pytest

from kvsim.sim.api import default_workload
from kvsim.sim.cluster import parallel
from kvsim.sim.cluster.run import simulate_cluster
from kvsim.sim.engine.config import SimConfig
from kvsim.sim.engine.run import simulate
from kvsim.workloads.request import Workload, make_request

# open loop: every turn at its arrival time, so an oblivious router's replicas never interact
CFG = SimConfig(num_gpu_blocks=200, replicas=3, closed_loop_sessions=False)


def _workload() -> Workload:
    """The default workload, plus a prompt longer than a replica's cache (rejected: its -1 in the
    load table comes from a rejection, not a finish)."""
    reqs = list(default_workload())
    reqs.insert(40, make_request("too-long", reqs[40].arrival, list(range(200 * 16 + 5)), 4))
    return Workload.from_list(reqs, "default+long")


def _same(a, b) -> None:
    pt.assert_frame_equal(a.received, b.received)
    pt.assert_frame_equal(a.load, b.load)
    assert a.summary == b.summary
    for x, y in zip(a.replicas, b.replicas, strict=True):
        pt.assert_frame_equal(x.requests, y.requests)
        pt.assert_frame_equal(x.steps, y.steps)
        assert x.summary == y.summary


@pytest.mark.parametrize("router", ["round-robin", "random", "session-affinity"])
def test_apart_is_one_clock_exactly(router):
    cfg = CFG.replace(router=router)
    one = simulate_cluster(_workload(), cfg, apart=False)
    heard: list[int] = []  # the workers' count of requests done, as the parent reads it
    apart = simulate_cluster(_workload(), cfg, heard.append, workers=2)
    _same(one, apart)
    _same(one, simulate_cluster(_workload(), cfg))  # (the default: apart, in this process)
    assert heard[-1] == 301 and heard == sorted(heard)
    statuses = {s for r in one.replicas for s in r.requests["status"]}
    assert statuses == {"finished", "rejected"}  # the long prompt's rejection is among them
    assert one.summary["cluster"]["overall"]["requests"] == 301
    for i in range(3):  # the requests kept, as one clock keeps them
        assert [r.id for r in apart.received_workload(i)] == [r.id for r in one.received_workload(i)]


def test_in_process_and_streamed_steps_match(tmp_path: Path):
    """`run_apart` with one worker (no fork) and the steps streamed into files, against one clock
    streaming them too; `progress` hears the requests done on every replica so far as the engines
    report them."""
    cfg = CFG.replace(router="round-robin")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    one = simulate_cluster(_workload(), cfg, steps_dir=tmp_path / "a", keep_requests=False, apart=False)
    routed, rest = parallel.plan(_workload(), cfg)
    assert rest == () and [len(r) for r in routed.received] == [101, 100, 100]
    from kvsim.sim.engine.cost_model import CostModel

    heard: list[int] = []
    files = [tmp_path / "b" / f"steps-{i}.parquet" for i in range(3)]
    replicas, changes = parallel.run_apart(routed, cfg, [CostModel.from_config(cfg)] * 3, "default+long", 0, 1, files,
                                           heard.append)
    assert heard == [64, 101, 165, 201, 265, 301]  # each engine's every 64 requests done, and its end
    assert len(changes) == 2 * 301
    for i, (x, y) in enumerate(zip(one.replicas, replicas, strict=True)):
        pt.assert_frame_equal(x.requests, y.requests)
        assert pq.read_table(tmp_path / "a" / f"steps-{i}.parquet").equals(pq.read_table(files[i]))
    assert one.requests_by_replica == []
    assert replicas[0].manager == parallel.ManagerFacts(200, 16, 1, ())


def test_what_cannot_run_apart_runs_on_one_clock():
    wl = list(_workload())
    # a router that reads the replicas
    assert parallel.plan(wl, CFG.replace(router="least-outstanding")) == (None, wl)
    assert parallel.plan(wl, CFG.replace(router="round-robin", kv_events=True)) == (None, wl)
    # closed-loop turns: the default workload's later turns wait on their previous turn's finish
    closed = CFG.replace(router="round-robin", closed_loop_sessions=True)
    routed, rest = parallel.plan(iter(wl), closed)
    assert routed is None and list(rest) == wl  # what was read of the stream comes back first
    one, fallback = _workload(), _workload()
    one.skipped = fallback.skipped = 2  # bad lines a loader skipped: each replica's summary counts them
    one, fallback = simulate_cluster(one, closed, apart=False), simulate_cluster(fallback, closed, workers=2)
    _same(one, fallback)
    assert fallback.replicas[0].summary["skipped_lines"] == 2
    apart = _workload()
    apart.skipped = 2
    assert simulate_cluster(apart, CFG.replace(router="round-robin"), workers=2).replicas[2].summary["skipped_lines"] == 2


def test_a_rounding_tie_keeps_the_cluster_on_one_clock():
    """Round-robin over 2 replicas: the 3rd request reaches the cluster, last at 0.0802..., at
    0.0894...15, but replica 0's lone front end, last at 0.0183..., would reach 0.0894...13 (SimPy adds
    a delay to the clock, and 0.0183 + (0.0894...15 - 0.0183) rounds to the even neighbour): `plan`
    sees it, and the cluster runs on one clock."""
    times = [0.01830855129861867, 0.08020555562669003, 0.08948467790810415, 2.924933405175646]
    reqs = [make_request(f"r{k}", t, list(range(20 * k, 20 * k + 30)), 3) for k, t in enumerate(times)]
    cfg = CFG.replace(replicas=2, router="round-robin")
    assert parallel.plan(reqs, cfg)[0] is None
    one = simulate_cluster(Workload.from_list(reqs, "tie"), cfg, apart=False)
    alone = simulate(one.received_workload(0), one.replay_config())
    reached = one.received.set_index("id")["arrival"]
    assert reached["r2"] == 0.08948467790810415
    assert alone.requests.set_index("id").loc["r2", "arrival"] == 0.08948467790810413  # an ulp apart
    _same(one, simulate_cluster(Workload.from_list(reqs, "tie"), cfg, workers=2))
    assert parallel.plan(reqs[:2], cfg)[0] is not None


def test_workers_for():
    assert parallel.workers_for(4, 3) == 3
    assert parallel.workers_for(2, 8) == 2
    assert parallel.workers_for(1, 8) == 1
    assert 1 <= parallel.workers_for(None, 64) == parallel.workers_for(0, 64) <= 64
    with pytest.raises(ValueError, match="workers must be >= 0"):
        parallel.workers_for(-1, 8)


def test_cli_workers_write_the_same_folder(tmp_path: Path):
    """`kvsim run --replicas 3 --router round-robin` on a trace (open loop): the folder written with
    its replicas apart in two processes is byte for byte the folder written apart in one (which the
    tests above hold to one clock's result)."""
    from typer.testing import CliRunner

    from kvsim.sim.cli.app import app

    rows = [f"2023-11-16 18:{15 + i // 60:02d}:{i % 60:02d}.{(37 * i) % 1000:03d}0000,{100 + 53 * i % 900},"
            f"{5 + 7 * i % 40}" for i in range(90)]
    trace = tmp_path / "azure.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    folders = {}
    for workers in ("1", "2"):
        out = folders[workers] = tmp_path / f"w{workers}"
        r = CliRunner().invoke(app, ["run", str(trace), "--replicas", "3", "--router", "round-robin",
                                     "--num-gpu-blocks", "64", "--workers", workers, "--no-plots", "-o", str(out)])
        assert r.exit_code == 0, r.output
    files = sorted(p.relative_to(folders["1"]) for p in folders["1"].rglob("*") if p.is_file())
    assert len(files) == 4 + 3 * 4  # config, summary, received, load; each replica: config, summary, requests, steps
    assert files == sorted(p.relative_to(folders["2"]) for p in folders["2"].rglob("*") if p.is_file())
    for f in files:
        assert (folders["1"] / f).read_bytes() == (folders["2"] / f).read_bytes(), f


def test_hybrid_groups_apart_and_offloading_apart():
    """A model in vLLM's hybrid groups (gpt-oss-20b: a window group and a full one), and KV offloading:
    apart as on one clock, each replica's groups kept for its run folder (`ManagerFacts`)."""
    cfg = CFG.replace(router="round-robin", model="gpt-oss-20b", num_gpu_blocks=400)
    one = simulate_cluster(_workload(), cfg, apart=False)
    apart = simulate_cluster(_workload(), cfg, workers=2)
    _same(one, apart)
    facts = apart.replicas[1].manager
    assert (facts.num_blocks, facts.num_groups) == (400, 2)
    assert [(g.kind, g.window) for g in facts.groups] == [("sliding_window", 128), ("full", None)]
    # (sync scheduling: the tier hits below are the sync scheduler's)
    cfg = CFG.replace(router="session-affinity", kv_offloading_size=0.05, num_gpu_blocks=100, async_scheduling=False)
    one = simulate_cluster(_workload(), cfg, apart=False)
    apart = simulate_cluster(_workload(), cfg, workers=2)
    _same(one, apart)
    assert [r.summary["offload_hit_tokens"] for r in apart.replicas] == [1600, 1264, 1360]
