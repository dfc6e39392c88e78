"""A cluster's KV events (issue 38 §3): every replica's step batches in one stream, ordered by
simulated time, then replica, then step (`sim/cluster/event_stream.py`), written by
`kvsim run --replicas N --kv-events FILE` a JSON line a batch.

vLLM publishes one `KVEventBatch` a step from each engine (vllm/v1/core/sched/scheduler.py,
`Scheduler.update_from_output`: `kv_cache_manager.take_events()`, then `KVEventBatch(ts=..., events=...)`),
each engine of a data-parallel deployment stamping its rank (vllm/distributed/kv_events.py,
`EventBatch.data_parallel_rank`; kvsim's `replica`). So each replica's batches must be exactly
those of a lone engine given the requests that replica received, at the times it received them."""

from __future__ import annotations

import json

import pytest
import simpy
from typer.testing import CliRunner

from kvsim.kvcache.events import MEDIUM_GPU, BlockStored, EventBatch
from kvsim.sim.api import default_workload
from kvsim.sim.cli.app import app
from kvsim.sim.cluster.event_stream import EventStream
from kvsim.sim.cluster.run import simulate_cluster
from kvsim.sim.engine.config import SimConfig
from kvsim.sim.engine.run import simulate

runner = CliRunner()
CFG = SimConfig(num_gpu_blocks=200, kv_events=True)


@pytest.fixture(scope="module")
def workload():
    return default_workload()


def lines_of(run_fn) -> list[str]:
    """The JSON lines a run hands its KV-event sink, as `kvsim run --kv-events` writes them."""
    lines: list[str] = []
    run_fn(lambda batch: lines.append(batch.json_line()))
    return lines


@pytest.mark.parametrize("router", ["round-robin", "llm-d-precise"])
def test_each_replicas_batches_are_its_lone_runs(workload, router):
    cfg = CFG.replace(replicas=3, router=router)
    written: list[str] = []
    run = simulate_cluster(workload, cfg, kv_events=lambda b: written.append(b.json_line()))
    batches = [json.loads(line) for line in written]
    keys = [(b["ts"], b["replica"], b["step"]) for b in batches]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)  # by time, then replica, then step
    assert sum(a["replica"] != b["replica"] for a, b in zip(batches, batches[1:], strict=False)) > 1000  # interleaved
    kept = simulate_cluster(workload, cfg)  # no sink: each replica's result keeps its own
    for i in range(3):
        alone = simulate(run.received_workload(i), run.replay_config())
        assert alone.kv_events, "a lone replica with no events would prove nothing"
        mine = [b for b in batches if b["replica"] == i]
        assert mine == [{**b.as_dict(), "replica": i} for b in alone.kv_events]  # field by field
        assert [b.as_dict() for b in kept.replicas[i].kv_events] == mine
    assert sum(len(r.kv_events) for r in kept.replicas) == len(batches)


def test_a_one_replica_clusters_batches_are_todays(workload, tmp_path):
    lone = lines_of(lambda sink: simulate(workload, CFG, kv_events=sink))
    assert len(lone) > 100
    assert lines_of(lambda sink: simulate_cluster(workload, CFG, kv_events=sink)) == lone
    events = tmp_path / "events.jsonl"
    r = runner.invoke(app, ["run", "--num-gpu-blocks", "200", "--no-plots", "--out", str(tmp_path / "r"),
                            "--kv-events", str(events)])
    assert r.exit_code == 0, r.output
    assert events.read_text().splitlines(keepends=True) == lone


def test_kvsim_run_writes_every_replicas_batches(workload, tmp_path):
    cfg = CFG.replace(replicas=3, router="llm-d-precise")
    want = lines_of(lambda sink: simulate_cluster(workload, cfg, kv_events=sink))
    events = tmp_path / "events.jsonl"
    r = runner.invoke(app, ["run", "--num-gpu-blocks", "200", "--replicas", "3", "--router", "llm-d-precise",
                            "--no-plots", "--out", str(tmp_path / "c"), "--kv-events", str(events)])
    assert r.exit_code == 0, r.output
    assert events.read_text().splitlines(keepends=True) == want
    assert {json.loads(line)["replica"] for line in want} == {0, 1, 2}


def test_a_failed_cluster_run_leaves_no_events_file(tmp_path, monkeypatch):
    import kvsim.sim.studies.cluster_folder as folder

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(folder, "write_cluster", broken)
    events = tmp_path / "events.jsonl"
    r = runner.invoke(app, ["run", "--num-gpu-blocks", "200", "--replicas", "2", "--no-plots",
                            "--out", str(tmp_path / "c"), "--kv-events", str(events)])
    assert r.exit_code != 0 and "disk full" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no events file, no temporary, no folder


def batch(ts: float, replica: int, step: int) -> EventBatch:
    return EventBatch(ts, replica, step, [BlockStored([step], None, [], 16, MEDIUM_GPU)])


def test_the_stream_orders_by_time_then_replica_then_step():
    env = simpy.Environment()
    to_router, out = [], []
    stream = EventStream(env, to_router.append, out.append)
    sent = [batch(2.0, 0, 9), batch(1.0, 1, 4), batch(1.0, 0, 7), batch(1.0, 0, 6)]
    for b in sent:
        stream.send(b)
    assert to_router == sent and out == []  # the router at once; the output only once the clock passes
    env.run(until=1.5)
    stream.send(batch(1.5, 2, 0))  # the clock at 1.5: every batch before it is final
    assert [(b.ts, b.replica, b.step) for b in out] == [(1.0, 0, 6), (1.0, 0, 7), (1.0, 1, 4)]
    stream.close()
    assert [(b.ts, b.replica, b.step) for b in out[3:]] == [(1.5, 2, 0), (2.0, 0, 9)]
    with pytest.raises(RuntimeError, match=r"^KV events out of order: replica 1's step 3 at t=1.75s came after "
                                           r"a batch at t=2.0s was written$"):
        stream.send(batch(1.75, 1, 3))
