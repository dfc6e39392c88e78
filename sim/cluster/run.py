"""Run a cluster: build N replicas of the engine a config describes, replay a workload through its
router, and summarize each replica and the whole (the `cluster` section of summary.json)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import simpy

from kvsim.kvcache.events import EventBatch
from kvsim.sim.cluster.cluster import Cluster, engine_config, replica_ops
from kvsim.sim.cluster.load import LoadChanges, imbalance, in_flight
from kvsim.sim.engine.config import ConfigError, SimConfig
from kvsim.sim.engine.metrics import STATUS, codes, percentiles, prefix_hits, slo_figures
from kvsim.sim.engine.run import RunResult, engine_result, make_manager, rare_collections
from kvsim.workloads.request import Request, Workload

if TYPE_CHECKING:
    from kvsim.sim.engine.cost_model import CostModel

REPLICA_FIGURES = ("requests", "finished", "hit_rate", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "goodput_rps")


@dataclass
class ClusterResult:
    """A finished cluster run: each replica's run (`replicas[i]`, a `RunResult` as `simulate`
    returns), the requests each received (`received`: id, arrival, replica: the time it reached
    its replica), each replica's in-flight requests over time (`load`), and the summary (the
    cluster section under `summary["cluster"]`; with one replica, that replica's summary besides)."""

    config: SimConfig
    workload: str
    replicas: list[RunResult]
    received: pd.DataFrame
    load: pd.DataFrame
    summary: dict[str, Any]
    requests_by_replica: list[list[Request]] = dataclasses.field(default_factory=list, repr=False)

    def received_workload(self, replica: int) -> Workload:
        """The requests replica `replica` received, each arriving when it reached the replica and
        with no think time: replayed alone through `simulate` with `load` 1 (`replay_config`),
        it gives that replica's tables exactly."""
        if not self.requests_by_replica:
            raise ValueError("received_workload: this run kept no requests (simulate_cluster(keep_requests=False), "
                             "as kvsim run runs it); `kvsim conform --cluster-run` rebuilds a replica's from the workload")
        return Workload.as_received(self.requests_by_replica[replica], f"{self.workload}-replica-{replica}")

    def replay_config(self, replica: int = 0) -> SimConfig:
        """The config replica `replica`'s `received_workload` replays under alone: its own (its
        `replica_pools` group's) with one replica and `load` 1 (its arrivals are already the times
        the requests reached it)."""
        return self.replicas[replica].config.replace(replicas=1, load=1.0)


def simulate_cluster(
    workload: Iterable[Request],
    cfg: SimConfig,
    progress: Callable[[int], None] | None = None,
    *,
    cost_model: CostModel | None = None,
    steps_dir: str | Path | None = None,
    keep_requests: bool = True,
    kv_events: Callable[[EventBatch], None] | None = None,
    workers: int | None = 1,
    apart: bool = True,
    ops_dir: str | Path | None = None,
) -> ClusterResult:
    """Replay `workload` through `cfg.replicas` replicas of the engine `cfg` describes behind
    `cfg.router`; deterministic for a given workload and config (the router's draws come from
    `cfg.seed`). `progress(n)` is called as requests finish. With `steps_dir`, each replica's
    steps table is written into it as the run goes (`steps-<i>.parquet`), so memory does not grow
    with the replicas' steps; the result reads them back on demand (`kvsim run` streams them into
    its scratch folder). Without `keep_requests` the result keeps only each request's id and
    arrival (`received`), not the requests (`received_workload` then refuses): a long run keeps no
    token arrays alive. With `cfg.kv_events`, every replica's KV-event batches are handed to
    `kv_events` in the order (ts, replica, step) (`sim.cluster.event_stream`), or kept on each
    replica's result (`replicas[i].kv_events`, no sink given). Replicas that never interact
    (`sim.cluster.parallel.plan`) run apart, one lone engine each, with the same result: in this
    process with `workers` 1, else in that many forked ones (None or 0: one per usable CPU); the
    others, and all with `apart` False, run on one clock. With `cfg.record_ops` the replicas run on
    one clock, each manager recording its op stream, kept in memory or, with `ops_dir`, streamed into
    `ops-<i>/` there by a writer thread each (`OpLog.stream_to`; `write_run` moves it into the
    replica's folder)."""
    cfg.validate()
    if cost_model is None:
        from kvsim.sim.engine.cost_model import CostModel

        cost_model = CostModel.from_config(cfg)
    configs, costs = cfg.replica_configs(), replica_costs(cfg, cost_model)
    source = workload  # (what `plan` leaves of it may be another iterable: its name and skipped lines are here)
    name = getattr(source, "name", "workload")
    files = None if steps_dir is None else [Path(steps_dir) / f"steps-{i}.parquet" for i in range(cfg.replicas)]
    if apart and cfg.replicas > 1 and not cfg.record_ops:
        from kvsim.sim.cluster import parallel

        routed, workload = parallel.plan(source, cfg)
        if routed is not None:  # (the source read whole: its skipped lines are known)
            n = parallel.workers_for(workers, cfg.replicas)
            replicas, changes = parallel.run_apart(routed, cfg, costs, name, getattr(source, "skipped", 0),
                                                   n, files, progress)
            received = [[(t, r if keep_requests else r.id) for t, r in got] for got in routed.received]
            return _result(cfg, name, replicas, received, changes, {}, keep_requests)
    managers = [make_manager(engine_config(c), k) for c, k in zip(configs, costs, strict=True)]
    _check_router_sizes(cfg, managers)
    env = simpy.Environment()
    kept: list[list[EventBatch]] | None = None
    if cfg.kv_events and kv_events is None:  # kept on each replica's result, as `simulate` keeps them
        kept = [[] for _ in range(cfg.replicas)]

        def kv_events(batch: EventBatch) -> None:
            kept[batch.replica].append(batch)
    cluster = Cluster(env, workload, cfg, cost_model, managers, progress, steps_files=files,
                      keep_requests=keep_requests, kv_events=kv_events if cfg.kv_events else None, costs=costs)
    with rare_collections(), replica_ops(managers, ops_dir):
        env.run()
    cluster.event_stream.close()
    if progress is not None:
        progress(cluster.num_done)
    skipped = getattr(source, "skipped", 0)
    replicas = [engine_result(e, configs[i], costs[i], name, skipped, None if files is None else files[i],
                              None if kept is None else kept[i]) for i, e in enumerate(cluster.engines)]
    return _result(cfg, name, replicas, cluster.received, cluster.load_events, cluster.expected, keep_requests)


def replica_costs(cfg: SimConfig, cost_model: CostModel) -> list[CostModel]:
    """Each replica's cost model, in replica order: `cost_model` for a group that sets nothing apart,
    its own for each other `replica_pools` group (shared by its replicas), as `simulate_pd` gives pools."""
    from kvsim.sim.engine.cost_model import CostModel

    out: list[CostModel] = []
    for count, c, own in cfg.replica_groups():
        out += [CostModel.from_config(c) if own else cost_model] * count
    return out


def _check_router_sizes(cfg: SimConfig, managers: list) -> None:
    """Refuse a router that sizes its index by one replica's blocks over replicas of different sizes."""
    sizes = {m.num_blocks for m in managers}
    if len(sizes) > 1 and cfg.router == "llm-d":
        raise ConfigError(f"router llm-d sizes each pod's approximate prefix LRU by one pod's blocks (its autoTune), "
                          f"and these replicas have {', '.join(f'{n:,}' for n in sorted(sizes))} blocks: give every "
                          "replica_pools group the same num_gpu_blocks, or pick another router")


def _result(cfg: SimConfig, name: str, replicas: list[RunResult], got: list[list[tuple[float, Any]]],
            changes: LoadChanges, expected: dict[str, int], keep_requests: bool) -> ClusterResult:
    """The cluster's result from its replicas' runs, the (time, request or its id) each received,
    and the router's in-flight changes: on one clock or apart, the same tables."""
    rows = [(r if type(r) is str else r.id, t, i) for i, pairs in enumerate(got) for t, r in pairs]
    received = pd.DataFrame(rows, columns=["id", "arrival", "replica"]).astype(
        {"id": "string", "arrival": np.float64, "replica": np.int32})
    received = received.sort_values(["arrival", "replica"], kind="stable").reset_index(drop=True)
    load = in_flight(changes, cfg.replicas)
    section = cluster_summary(replicas, load, cfg, expected)
    summary = {**replicas[0].summary, "cluster": section} if cfg.replicas == 1 else {
        "workload": name, "model": cfg.model, "gpu": cfg.gpu, "cluster": section}
    return ClusterResult(cfg, name, replicas, received, load, summary, got if keep_requests else [])


def cluster_point(params: dict[str, Any], workload: Any) -> dict[str, Any]:
    """One simulated cluster for a search over replicas (in a worker process): `params` a
    `SimConfig`'s dict, `workload` anything whose `open()` gives the requests (a study's
    `WorkloadSpec`); returns the cluster section (`overall["slo_attainment"]` among it)."""
    cfg = SimConfig.from_dict(params, source="point")
    return simulate_cluster(workload.open(), cfg).summary["cluster"]


# the cluster section's overall figures a sweep records a cluster point by, under the names the
# one-engine summary gives the same figures (`sim.engine.metrics.summarize`), so a grid that mixes
# one replica and several compares them in the same columns
SWEEP_FIGURES = ("requests", "finished", "hit_rate", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99",
                 "goodput_rps", "slo_attainment", "duration_s")


def sweep_figures(summary: dict[str, Any]) -> dict[str, Any]:
    """A cluster run's summary as one flat record of a sweep point (scalars only, one table
    column each): what ran (workload, model, GPU, replicas, router), the overall figures
    (`SWEEP_FIGURES`, plus `throughput_rps`: finished requests over the span, as one engine's),
    and the load imbalance (`imbalance_mean`, `imbalance_peak`)."""
    section = summary["cluster"]
    overall = section["overall"]
    span = overall["duration_s"]
    return {"workload": summary["workload"], "model": summary["model"], "gpu": summary["gpu"],
            "replicas": section["replicas"], "router": section["router"],
            **{k: overall[k] for k in SWEEP_FIGURES},
            "throughput_rps": overall["finished"] / span if span else 0.0,
            "imbalance_mean": section["imbalance_mean"], "imbalance_peak": section["imbalance_peak"]}


def prediction(requests: pd.DataFrame, expected: dict[str, int]) -> dict[str, int] | None:
    """Where a prefix-aware router's belief met the cache: over the requests it routed that were
    admitted, the prompt tokens it expected the chosen replica to hit (its index at the pick)
    against those the replica hit at first admission; `over` counts the requests it expected more
    of (`over_tokens` the tokens it expected and did not get), `under` those that hit more. None for
    a router that expects nothing."""
    if not expected:
        return None
    adm = requests.loc[requests["first_scheduled"].notna(), ["id", "hit_tokens"]]
    exp = adm["id"].map(expected)
    adm, exp = adm[exp.notna()], exp[exp.notna()].astype(np.int64)
    hit = adm["hit_tokens"].astype(np.int64)
    gap = exp - hit
    return {"requests": len(adm), "expected_tokens": int(exp.sum()), "hit_tokens": int(hit.sum()),
            "over": int((gap > 0).sum()), "over_tokens": int(gap.clip(lower=0).sum()),
            "under": int((gap < 0).sum()), "under_tokens": int((-gap).clip(lower=0).sum())}


def cluster_summary(replicas: list[RunResult], load: pd.DataFrame, cfg: SimConfig,
                    expected: dict[str, int] | None = None) -> dict[str, Any]:
    """The cluster section: router and replicas, each replica's figures (`REPLICA_FIGURES`), the
    same figures over every replica's requests together, the load imbalance, and for a
    prefix-aware router its `prediction` against the hits (`prediction`)."""
    per = [{k: r.summary[k] for k in REPLICA_FIGURES} for r in replicas]
    if cfg.replica_pools:  # replicas that differ: what each runs on
        for f, r in zip(per, replicas, strict=True):
            f["pool"] = f"{r.config.gpu} x{r.config.tensor_parallel}, {int(r.summary['num_gpu_blocks']):,} blocks"
    requests = pd.concat([r.requests for r in replicas], ignore_index=True)
    done = codes(requests["status"], STATUS) == STATUS.index("finished")
    ends = [float(r.step_columns("time").iloc[-1, 0] + r.step_columns("duration").iloc[-1, 0])
            for r in replicas if r.num_steps]
    span = max(max(ends) - float(requests["arrival"].min()), 0.0) if ends and len(requests) else 0.0
    overall: dict[str, Any] = {"requests": len(requests), "finished": int(done.sum()),
                               "hit_rate": prefix_hits(requests, replicas[0].manager.block_size,
                                                                  cfg.parallel_sampling == "fanout")["hit_rate"]}
    for col in ("ttft", "tpot"):
        figures = percentiles(requests[col].to_numpy()[done], col)
        overall.update({f"{col}_p50": figures[f"{col}_p50"], f"{col}_p99": figures[f"{col}_p99"]})
    overall.update(slo_figures(requests, cfg.slo_ttft, cfg.slo_tpot, span))
    overall["duration_s"] = span
    return {"replicas": cfg.replicas, "router": cfg.router, "router_metrics_interval": cfg.router_metrics_interval,
            "per_replica": per, "overall": overall, **imbalance(load),
            "prediction": prediction(requests, expected or {})}
