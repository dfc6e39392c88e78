"""A cluster's replicas are exact engines: one replica gives `simulate`'s tables, and each replica's
received requests, replayed alone, give that replica's tables; sessions are routed turn by turn,
and a router sees engine metrics only as of the latest snapshot."""

import pandas.testing as pt
import pyarrow.parquet as pq
import pytest

from kvsim.sim.api import default_workload
from kvsim.sim.cluster import cluster as cluster_module
from kvsim.sim.cluster.routers import RoundRobin
from kvsim.sim.cluster.run import simulate_cluster
from kvsim.sim.engine.config import ROUTER_NAMES, ConfigError, SimConfig
from kvsim.sim.engine.run import simulate
from kvsim.workloads.request import Workload, make_request

CFG = SimConfig(num_gpu_blocks=512)


@pytest.fixture(scope="module")
def workload():
    return default_workload()


@pytest.mark.parametrize("router", ["round-robin", "vllm-dp"])
def test_one_replica_is_todays_run(workload, router):
    lone = simulate(workload, CFG)
    run = simulate_cluster(workload, CFG.replace(router=router))
    pt.assert_frame_equal(run.replicas[0].steps, lone.steps)
    pt.assert_frame_equal(run.replicas[0].requests, lone.requests)
    summary = dict(run.summary)
    section = summary.pop("cluster")
    assert summary == lone.summary
    assert section["per_replica"][0]["requests"] == 300
    assert section["overall"]["hit_rate"] == lone.summary["hit_rate"]
    assert section["imbalance_mean"] == 1.0


@pytest.mark.parametrize("router", ROUTER_NAMES)
def test_each_replica_replays_alone_exactly(workload, router):
    run = simulate_cluster(workload, CFG.replace(num_gpu_blocks=200, replicas=3, router=router))
    assert sum(len(r.requests) for r in run.replicas) == 300
    assert len(run.received) == 300
    for i, replica in enumerate(run.replicas):
        alone = simulate(run.received_workload(i), run.replay_config())
        pt.assert_frame_equal(alone.requests, replica.requests)
        pt.assert_frame_equal(alone.steps, replica.steps)
        got = run.received[run.received["replica"] == i]
        assert list(got["id"]) == list(replica.requests["id"])
        assert list(got["arrival"]) == list(replica.requests["arrival"])


@pytest.mark.parametrize("router", ["round-robin", "llm-d-precise"])
def test_each_replicas_op_stream_is_its_lone_runs(workload, router):
    """With `record_ops` each replica records its op stream (on one clock), and it is the stream its
    received requests give a lone engine, op for op, tokens too (what `kvsim gpu-replay` replays)."""
    run = simulate_cluster(workload, CFG.replace(num_gpu_blocks=200, replicas=2, router=router, record_ops=True))
    for i, replica in enumerate(run.replicas):
        alone = simulate(run.received_workload(i), run.replay_config())
        ops = replica.manager.ops.records()
        assert len(ops) > 1000 and ops == alone.manager.ops.records()
        mine, lone = replica.manager.ops.tokens, alone.manager.ops.tokens
        assert mine.keys() == lone.keys() and all((mine[k] == v).all() for k, v in lone.items())


def test_runs_are_deterministic_and_seeded(workload):
    cfg = CFG.replace(replicas=3, router="random", num_gpu_blocks=200)
    a, b = simulate_cluster(workload, cfg), simulate_cluster(workload, cfg)
    pt.assert_frame_equal(a.received, b.received)
    assert a.summary == b.summary
    c = simulate_cluster(workload, cfg.replace(seed=1))
    assert list(c.received["replica"]) != list(a.received["replica"])


def test_streamed_steps_give_the_same_tables(workload, tmp_path, monkeypatch):
    """With `steps_dir` each replica's steps stream into a file, `STEP_SEGMENT` rows a row group
    (here 48), and without `keep_requests` only ids and arrivals are kept (flat memory for many
    replicas): the tables and summaries are those of the run that keeps everything in memory."""
    monkeypatch.setattr(cluster_module, "STEP_SEGMENT", 48)
    cfg = CFG.replace(replicas=3, router="least-outstanding", num_gpu_blocks=200)
    kept, streamed = simulate_cluster(workload, cfg), simulate_cluster(workload, cfg, steps_dir=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["steps-0.parquet", "steps-1.parquet", "steps-2.parquet"]
    for i, replica in enumerate(kept.replicas):
        groups = pq.ParquetFile(tmp_path / f"steps-{i}.parquet").metadata
        rows = [groups.row_group(g).num_rows for g in range(groups.num_row_groups)]
        full, rest = divmod(replica.num_steps, 48)
        assert full >= 2 and rows == [48] * full + ([rest] if rest else [])
    for a, b in zip(kept.replicas, streamed.replicas, strict=True):
        pt.assert_frame_equal(a.steps, b.steps)
        pt.assert_frame_equal(a.requests, b.requests)
    assert kept.summary == streamed.summary
    lean = simulate_cluster(workload, cfg, keep_requests=False)  # ids and arrivals, no requests kept
    pt.assert_frame_equal(lean.received, kept.received)
    assert lean.summary == kept.summary
    with pytest.raises(ValueError, match=r"^received_workload: this run kept no requests"):
        lean.received_workload(0)


def _chat(think: float) -> Workload:
    """Two sessions of three turns each, all given as arriving at 0 (closed loop places them)."""
    reqs = [make_request(f"{s}-{t}", 0.0, list(range(100 * t + 1)), 8, session=s,
                         think_time=None if t == 0 else think) for t in range(3) for s in ("a", "b")]
    return Workload.from_list(reqs, "chat")


def test_session_turns_are_routed_when_released():
    run = simulate_cluster(_chat(0.5), SimConfig(num_gpu_blocks=64, replicas=2, router="round-robin"))
    finish = {}
    for r in run.replicas:
        finish.update(zip(r.requests["id"], r.requests["finish"], strict=True))
    got = dict(zip(run.received["id"], zip(run.received["arrival"], run.received["replica"], strict=True), strict=True))
    for s in ("a", "b"):
        for t in (1, 2):
            assert got[f"{s}-{t}"][0] == finish[f"{s}-{t - 1}"] + 0.5  # released think_time after the last turn
    # round-robin in release order: a-0, b-0 at 0, then each later turn as its predecessor ends
    order = run.received.sort_values("arrival", kind="stable")
    assert list(order["replica"]) == [0, 1, 0, 1, 0, 1]


def test_session_affinity_keeps_a_session_on_one_replica():
    run = simulate_cluster(_chat(0.5), SimConfig(num_gpu_blocks=64, replicas=3, router="session-affinity"))
    by_session = run.received.assign(session=run.received["id"].str[0]).groupby("session")["replica"].unique()
    assert {k: [int(x) for x in v] for k, v in by_session.items()} == {"a": [2], "b": [2]}  # uhashring agrees


class Spy(RoundRobin):
    """Round-robin that reads the snapshots and records what it saw at each pick."""

    reads_metrics = True

    def __init__(self, n, env_of):
        super().__init__(n)
        self.env_of = env_of
        self.seen = []

    def pick(self, request, view):
        self.seen.append((request.id, view.metrics_time, view.metrics[0].running + view.metrics[0].waiting))
        return 0


def test_a_router_sees_engine_metrics_only_as_of_the_last_snapshot():
    import simpy

    from kvsim.sim.cluster.cluster import Cluster
    from kvsim.sim.engine.cost_model import CostModel
    from kvsim.sim.engine.run import make_manager

    cfg = SimConfig(num_gpu_blocks=64, replicas=1, router_metrics_interval=1.0, step_time=0.1)
    reqs = [make_request(f"r{i}", t, list(range(16)), 40) for i, t in enumerate((0.05, 0.5, 0.95, 1.05, 2.5))]
    env = simpy.Environment()
    cost = CostModel.from_config(cfg)
    spy = Spy(1, env)
    cluster = Cluster(env, reqs, cfg, cost, [make_manager(cfg, cost)], router=spy)
    env.run()
    # r0 runs from 0.1 (40 steps of 0.1 s), but until the snapshot at 1.0 the router sees nothing;
    # at 1.05 it sees r0, r1 and r2 (the snapshot at 1.0), at 2.5 the same three (2.0's)
    assert spy.seen == [("r0", 0.0, 0), ("r1", 0.0, 0), ("r2", 0.0, 0), ("r3", 1.0, 3), ("r4", 2.0, 4)]
    assert cluster.view.finished == [5]


@pytest.mark.parametrize(("change", "message"), [
    ({"replicas": 0}, "replicas must be an integer >= 1, got 0"),
    ({"router": "fastest"}, "router must be one of round-robin, random, least-outstanding, vllm-dp, vllm-dp-legacy, "
                            "session-affinity, llm-d-precise, dynamo, llm-d, sglang-cache-aware, got 'fastest'"),
    ({"router_metrics_interval": 0}, "router_metrics_interval must be a positive number of seconds, got 0"),
    ({"router_cache_threshold": 1.5}, "router_cache_threshold must be a number in [0, 1], got 1.5"),
    ({"router_balance_abs": -1}, "router_balance_abs must be an integer >= 0, got -1"),
    ({"router_balance_rel": 0}, "router_balance_rel must be a positive number, got 0"),
    ({"router_tree_size": 2.5}, "router_tree_size must be an integer >= 0, got 2.5"),
    ({"router_eviction_interval": float("inf")}, "router_eviction_interval must be a positive number, got inf"),
])
def test_bad_cluster_settings_are_named(change, message):
    with pytest.raises(ConfigError) as e:
        SimConfig(**change).validate()
    assert str(e.value) == message


def test_prediction_against_the_hits_by_hand():
    """Three admitted requests (one not yet admitted, one the router expected nothing of): a, 32
    expected and 16 hit (over by 16); b, 0 and 48 (under by 48); c, 64 and 64."""
    import numpy as np
    import pandas as pd

    from kvsim.sim.cluster.run import prediction

    requests = pd.DataFrame({"id": ["a", "b", "c", "d", "e"], "hit_tokens": [16, 48, 64, 0, 32],
                             "first_scheduled": [0.1, 0.2, 0.3, np.nan, 0.4]})
    got = prediction(requests, {"a": 32, "b": 0, "c": 64, "d": 16})
    assert got == {"requests": 3, "expected_tokens": 96, "hit_tokens": 128, "over": 1, "over_tokens": 16,
                   "under": 1, "under_tokens": 48}
    assert prediction(requests, {}) is None


@pytest.mark.parametrize("router", ["llm-d", "llm-d-precise", "dynamo", "round-robin"])
def test_a_prefix_aware_routers_prediction_is_its_belief_at_each_pick(workload, router, monkeypatch):
    """The cluster keeps what the router expected the chosen replica to hit at each pick (its
    `expected_tokens`), and the section compares it with each request's hit; a router that
    expects nothing has none."""
    from kvsim.sim.cluster import routers
    from kvsim.sim.cluster.run import prediction

    seen: dict[str, int] = {}
    cls = routers.ROUTERS[router]
    pick = cls.pick

    def spy(self, request, view):
        chosen = pick(self, request, view)
        if hasattr(self, "expected_tokens"):
            seen[request.id] = self.expected_tokens
        return chosen

    monkeypatch.setattr(cls, "pick", spy)
    run = simulate_cluster(workload, CFG.replace(replicas=3, router=router, num_gpu_blocks=200))
    section = run.summary["cluster"]["prediction"]
    if router == "round-robin":
        assert section is None and seen == {}
        return
    import pandas as pd

    requests = pd.concat([r.requests for r in run.replicas], ignore_index=True)
    assert len(seen) == 300 and section == prediction(requests, seen)
    assert section["requests"] == 300 and section["expected_tokens"] > 0
    assert section["over"] + section["under"] <= 300


@pytest.mark.parametrize("router", ["llm-d", "sglang-cache-aware"])
def test_a_lightly_loaded_one_clock_cluster_takes_async_quiet_runs_exactly(workload, router, monkeypatch):
    """Replicas behind a router that reads them share one clock; at a tenth of the workload's rate
    each takes its steps of lazy decodes alone (and those of plain decodes) in runs
    (`sim.engine.async_quiet`), yielding to the others where the general step yields: every replica's tables and the cluster's summary are those
    of the run with the shortcuts off."""
    from kvsim.sim.engine.async_quiet import AsyncQuietRuns
    from tests.sim.engine.test_quiet_runs import built

    made = built(monkeypatch, AsyncQuietRuns)
    cfg = CFG.replace(replicas=3, router=router, load=0.1)
    fast = simulate_cluster(workload, cfg)
    taken = [(q.taken - q.decoded, q.decoded) for q in made]
    assert taken == {"llm-d": [(13716, 1487), (2589, 250), (17593, 2008)],
                     "sglang-cache-aware": [(9475, 1009), (16064, 1775), (8900, 924)]}[router], taken
    slow = simulate_cluster(workload, cfg.replace(shortcuts=False))
    for a, b in zip(fast.replicas, slow.replicas, strict=True):
        pt.assert_frame_equal(a.steps, b.steps)
        pt.assert_frame_equal(a.requests, b.requests)
    assert fast.summary == slow.summary
    pt.assert_frame_equal(fast.load, slow.load)


@pytest.mark.parametrize("router", ["vllm-dp", "llm-d"])
def test_snapshot_ticks_before_the_next_event_are_counted_not_taken(workload, router, monkeypatch):
    """`Cluster._snapshots` takes a tick only if something may have happened since the last one (an
    event before it in SimPy's queue), and counts the others (`next_snapshot`): the router sees the
    same metrics, the same snapshot count (vllm-dp resets its copy on it) and the same snapshot time
    at every pick, and the cluster's tables are those of taking every tick."""
    from kvsim.sim.cluster import cluster as cluster_mod
    from kvsim.sim.cluster import routers

    seen = []
    taken = []
    metrics = cluster_mod.Cluster.metrics

    def counted(self, replica):
        taken.append(replica)
        return metrics(self, replica)

    def spy_pick(pick):
        def wrapped(self, request, view):
            seen.append((request.id, view.snapshots, view.metrics_time, view.metrics))
            return pick(self, request, view)
        return wrapped

    router_cls = routers.ROUTERS[router]
    monkeypatch.setattr(router_cls, "pick", spy_pick(router_cls.pick))
    monkeypatch.setattr(cluster_mod.Cluster, "metrics", counted)
    cfg = CFG.replace(replicas=2, router=router, load=0.1)
    fast = simulate_cluster(workload, cfg)
    fast_seen, fast_taken = list(seen), len(taken)
    seen.clear()
    taken.clear()
    monkeypatch.setattr(cluster_mod, "next_snapshot", lambda env, k, interval, views: k + 1)  # every tick taken
    slow = simulate_cluster(workload, cfg)
    assert fast_seen == seen and len(seen) == 300
    assert fast_taken < len(taken) / 2, (fast_taken, len(taken))
    for a, b in zip(fast.replicas, slow.replicas, strict=True):
        pt.assert_frame_equal(a.steps, b.steps)
        pt.assert_frame_equal(a.requests, b.requests)
    assert fast.summary == slow.summary
