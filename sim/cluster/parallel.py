"""A cluster whose replicas never interact, simulated apart: one process a replica at a time.

Behind an oblivious router (`Router.oblivious`: round-robin, random, session-affinity) each pick
depends only on the requests in order, the seed and the router's own dispatch counts, so with
open-loop arrivals every request's replica and the time it reaches it are known before anything
runs. Each replica is then a lone engine given the requests it receives at those times, which
gives exactly the tables it has in the cluster (`ClusterResult.received_workload`,
`tests/sim/cluster/test_exact.py`), so the replicas can run in separate processes and the cluster
is put together from their results: the same `ClusterResult`, table for table, as one clock gives
(`tests/sim/cluster/test_parallel.py`).

Not apart: a router that reads the replicas (metrics, KV events, finishes), closed-loop sessions
whose later turns wait on an earlier turn's finish (the release time then depends on the replica
that ran it), `kv_events`. `plan` says None for those, and `simulate_cluster` runs them on one clock.

Apart is also cheaper in one process (`workers` 1): each lone engine runs ahead on its own clock,
where on one clock every replica's step is a SimPy event the others wait behind (the Azure trace's
8 replicas: 5.3 s against 9.2 s of CPU). Worker processes are forked, so each inherits the requests
routed to it instead of receiving a copy; each sends back its replica's `RunResult` with a
`ManagerFacts` in place of its block manager (the figures the cluster's summary and run folder
read of it).
"""

from __future__ import annotations

import multiprocessing
import os
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, Any

import simpy

from kvsim.sim.cluster.cluster import STEP_SEGMENT
from kvsim.sim.cluster.load import LoadChanges
from kvsim.sim.cluster.routers import ROUTERS, RouterView, make_router
from kvsim.sim.engine.config import SimConfig
from kvsim.sim.engine.loop import Engine
from kvsim.sim.engine.run import RunResult, engine_result, make_manager, rare_collections
from kvsim.workloads.request import Request, Workload

if TYPE_CHECKING:
    from kvsim.sim.engine.cost_model import CostModel


@dataclass(frozen=True)
class ManagerFacts:
    """What the parent reads of a replica's block manager once the replica ran in a worker: the
    pool's size and block size, and its KV-cache groups' specs (`kvsim.sim.studies.run_folder`)."""

    num_blocks: int
    block_size: int
    num_groups: int
    groups: tuple

    @classmethod
    def of(cls, manager: Any) -> ManagerFacts:
        return cls(manager.num_blocks, manager.block_size, getattr(manager, "num_groups", 1),
                   tuple(getattr(manager, "groups", ())))


@dataclass
class Plan:
    """Where every request goes: `received[i]` the (time, request) pairs replica i gets, in order."""

    received: list[list[tuple[float, Request]]]


def workers_for(requested: int | None, replicas: int) -> int:
    """Processes to run `replicas` apart in: `requested`, or with None (or 0) this machine's usable
    CPUs; never more than the replicas."""
    if requested is not None and requested < 0:
        raise ValueError(f"workers must be >= 0 (0: one per usable CPU), got {requested}")
    if not requested:
        requested = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(requested, replicas))


def plan(workload: Iterable[Request], cfg: SimConfig) -> tuple[Plan | None, Iterable[Request]]:
    """Route `workload` ahead of the run if its replicas never interact: (the plan, nothing left)
    or, where they may, (None, the workload as it still is: what was read of it, then the rest)."""
    if not getattr(ROUTERS[cfg.router], "oblivious", False) or cfg.kv_events:
        return None, workload
    router = make_router(cfg.router, cfg.replicas, cfg.seed, cfg)
    closed = cfg.closed_loop_sessions and cfg.step_time is None
    view = RouterView(cfg.replicas)
    received: list[list[tuple[float, Request]]] = [[] for _ in range(cfg.replicas)]
    lone = [0.0] * cfg.replicas  # each replica's lone front end's clock, given its requests at those times
    read: list[Request] = []
    stream: Iterator[Request] = iter(workload)
    now, load = 0.0, cfg.load
    for req in stream:
        read.append(req)
        if closed and req.session is not None and req.think_time is not None:
            return None, chain(read, stream)  # a later turn waits on its previous one's finish
        delay = req.arrival / load - now  # as `Frontend._arrivals` advances the clock
        if delay > 0:
            now = now + delay
        view.now = now
        i = router.pick(req, view)
        view.dispatched[i] += 1
        received[i].append((now, req))
        # its lone engine's front end reaches `now` from its own last arrival: SimPy's now + (t - now)
        # can miss t by an ulp where the clock more than doubles (a rounding tie), and then the
        # replica would not be the cluster's (rare: the run goes on one clock)
        gap = now - lone[i]
        if gap > 0:
            lone[i] = lone[i] + gap
            if lone[i] != now:
                return None, chain(read, stream)
    return Plan(received), ()


# the run a forked worker reads (set by `run_apart` before its pool forks, so each inherits it)
_JOB: dict[str, Any] = {}
PROGRESS_S = 0.2  # how often the parent reads the workers' count of requests done


def _replica(i: int) -> tuple[int, RunResult, array]:
    """Replica `i` run alone (in a worker): its result, and when each of its requests finished or
    was dropped (the router's view of its in-flight count). Its finishes are added to the shared
    count `done` as the engine reports them, for the parent's progress."""
    job = _JOB
    cfg: SimConfig = job["configs"][i]  # (its `replica_pools` group's)
    cost = job["costs"][i]
    manager = make_manager(cfg, cost)
    env = simpy.Environment()
    requests = Workload.as_received(job["received"][i], job["name"])
    files = job["files"]
    told = [0]  # finishes added to the shared count so far
    done_count = job["done"]
    echo = job["echo"]  # (in this process: the caller's progress, told at once)

    def tell(n: int) -> None:
        if n == told[0]:
            return
        with done_count.get_lock():
            done_count.value += n - told[0]
        told[0] = n
        if echo is not None:
            echo(done_count.value)

    engine = Engine(env, requests, cfg.replace(replicas=1, load=1.0), cost, manager,
                    None if done_count is None else tell,
                    steps_file=None if files is None else files[i], steps_segment=STEP_SEGMENT)
    done_at = array("d")
    front_done = engine.front.done

    def done(req: Request, now: float) -> None:
        done_at.append(now)
        front_done(req, now)

    engine.front.done = done
    with rare_collections():
        env.run()
    if done_count is not None:
        tell(len(done_at))
    result = engine_result(engine, cfg, cost, job["name"], job["skipped"], None if files is None else files[i])
    return i, replace(result, manager=ManagerFacts.of(manager)), done_at


def run_apart(the_plan: Plan, cfg: SimConfig, costs: list[CostModel], name: str, skipped: int, workers: int,
              steps_files: list[Path] | None = None,
              progress: Callable[[int], None] | None = None) -> tuple[list[RunResult], LoadChanges]:
    """Each replica of `the_plan` run alone, `workers` at a time in forked processes (in this one
    with 1): their results in replica order, and the router's in-flight changes (+1 as a request
    reaches its replica, -1 as it is done there); `costs[i]` is replica i's cost model (its config:
    `cfg.replica_configs()[i]`). `progress(n)`: the requests done on every replica
    so far, as the engines report them (every `PROGRESS_EVERY`) and as each replica ends."""
    ctx = multiprocessing.get_context("fork")
    done_count = ctx.Value("q", 0) if progress is not None else None
    _JOB.update(configs=cfg.replica_configs(), costs=costs, received=the_plan.received, name=name, skipped=skipped, files=steps_files,
                done=done_count, echo=progress if workers == 1 else None)
    results: list[RunResult | None] = [None] * cfg.replicas
    done_at = [array("d") for _ in range(cfg.replicas)]
    pool = None
    try:
        if workers == 1:
            for i in range(cfg.replicas):
                _, results[i], done_at[i] = _replica(i)
        else:
            pool = ctx.Pool(workers)
            pending = [pool.apply_async(_replica, (i,)) for i in range(cfg.replicas)]
            while pending:
                pending[0].wait(PROGRESS_S)
                for job in [job for job in pending if job.ready()]:
                    i, results[i], done_at[i] = job.get()  # (a worker's error is raised here)
                    pending.remove(job)
                if progress is not None:
                    progress(done_count.value)
            pool.close()
            pool.join()
    finally:
        if pool is not None:
            pool.terminate()
        _JOB.clear()
    changes = LoadChanges()
    for i, got in enumerate(the_plan.received):
        for t, _ in got:
            changes.add(t, i, 1)
    for i, times in enumerate(done_at):
        for t in times:
            changes.add(t, i, -1)
    return results, changes  # type: ignore[return-value]
