"""A cluster: N exact replicas of the engine on one SimPy clock, behind a router.

Scenario: the workload reaches the cluster through the same front end a lone engine has
(`sim.engine.frontend.Frontend`: arrival times, closed-loop sessions), so a session's later turn
is routed only when it is released, `think_time` after its previous turn finished on whichever
replica ran it. Each release asks the router for a replica (`sim.cluster.routers`) and hands the
request to that replica's engine at once. Each replica is a full `sim.engine.loop.Engine` with
its own scheduler and block manager; only its front end differs (`ReplicaFront`: requests come
from the router, not from a workload), so a replica given a sub-workload behaves as a lone engine
given the same requests at the same times (`tests/sim/cluster/test_exact.py`).

Why `ReplicaFront.upto` differs from the lone front end's: an engine runs ahead of the SimPy clock
while no event falls before its own clock, and before applying a step's output at time t it lets
every event at or before t happen. Alone, it loops `timeout(0)` until none is left; two replicas
doing that at the same t would hand the turn back and forth for ever. A replica instead waits on
one event at t of a priority after SimPy's normal one: every normal event at or before t (an
arrival, a session's release, another replica's step) happens first. Left open: a request that
another replica's output releases at exactly t (a zero think time, equal float step ends) may
reach it after its own output at t, where a lone engine would queue it first.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import simpy
from simpy.events import NORMAL, Event

from kvsim.kvcache.events import EventBatch
from kvsim.sim.cluster.event_stream import EventStream
from kvsim.sim.cluster.kv_index import DelayedEvents
from kvsim.sim.cluster.load import LoadChanges
from kvsim.sim.cluster.routers import EngineMetrics, Router, RouterView, make_router
from kvsim.sim.engine.config import EVENT_ROUTERS, SimConfig
from kvsim.sim.engine.frontend import Frontend
from kvsim.sim.engine.loop import PROGRESS_EVERY, Engine
from kvsim.workloads.request import Request

LATE = NORMAL + 1  # after every normal event at the same time
# rows a replica's streamed step log holds before writing them (a lone engine's: 65,536, ~13 MB, which
# 64 replicas would hold each until the end; this one ~1.3 MB, its last quarter as tuples)
STEP_SEGMENT = 4096


class _Late(Event):
    """An event `delay` seconds on that fires after every normal event at its time (SimPy's
    `Timeout`, at priority LATE)."""

    def __init__(self, env: simpy.Environment, delay: float):
        super().__init__(env)
        self._ok = True
        self._value = None
        env.schedule(self, LATE, delay)


def engine_config(cfg: SimConfig) -> SimConfig:
    """The config each replica's engine and block manager run under: with a router fed by KV events
    (`EVENT_ROUTERS`), `kv_events` on, so each step's events are queued (the speed shortcuts keep
    each step's batch as plain stepping queues it: tests/sim/engine/test_events_shortcuts.py)."""
    return cfg.replace(kv_events=True) if cfg.router in EVENT_ROUTERS else cfg


@contextmanager
def replica_ops(managers: list, ops_dir: str | Path | None) -> Iterator[None]:
    """While the replicas run: with op records and `ops_dir`, each replica's manager streams its op
    stream into `ops-<i>/` there, on a writer thread (a child process a replica would crowd the CPUs),
    in chunks cut by the replicas sharing this process (`OpLog.stream_to`'s `share`), and hands the
    writer its last ops once they are done; `write_run` moves each stream into its replica's folder."""
    streaming = []
    for i, m in enumerate(managers):
        if ops_dir is not None and m.records_ops:
            folder = Path(ops_dir) / f"ops-{i}"
            folder.mkdir(parents=True, exist_ok=True)
            m.stream_ops(folder, process=False, share=len(managers))
            streaming.append(m)
    yield
    for m in streaming:
        m.finish_ops()


def next_snapshot(env: simpy.Environment, k: int, interval: float, views: Iterable[RouterView]) -> int:
    """The tick after tick k that may see a change, the ticks before it counted into `views` as
    taken (their count and the latest one's time; their metrics are the last ones): nothing
    happens before the next event in SimPy's queue (the snapshot process itself is running, not
    queued), so a tick before it would read what tick k read. Ticks at its time or after are taken,
    in the order they were (scheduled before it, as each tick schedules the next)."""
    nxt, first = env.peek(), k + 1
    k = first
    if nxt != math.inf:
        while k * interval < nxt:
            k += 1
    if k > first:
        for view in views:
            view.snapshots += k - first
            view.metrics_time = (k - 1) * interval
    return k


def engine_metrics(engine: Engine) -> EngineMetrics:
    """An engine's metrics now, as vLLM's SchedulerStats reports them (waiting, running, KV usage)."""
    sched = engine.sched
    m = sched.m
    usable = m.num_usable_blocks
    return EngineMetrics(len(sched.waiting), len(sched.running), 1.0 - m.num_free_blocks / usable if usable else 0.0)


class ReplicaFront:
    """A replica's front end: the engine's arrivals are the router's hand-offs (`hand`), and it
    is idle when the cluster's front end is (no request will ever reach any replica again)."""

    def __init__(self, cluster: Cluster, index: int, admit: Callable[[Request], None]):
        self.cluster = cluster
        self.index = index
        self.env = cluster.env
        self.admit = admit
        self._wake: simpy.Event | None = None
        self._poked_at = 0.0  # the latest clock a poke came from
        self._held: list[tuple[Request, float]] | None = None  # hand-offs while the engine waits `ahead`

    def hand(self, req: Request) -> None:
        """The router picked this replica for `req`: it reaches the engine now (held, with its time,
        while the engine waits for its next schedule: `ahead`)."""
        if self._held is not None:
            self._held.append((req, self.env.now))
            return
        self.admit(req)
        self.poke()

    @property
    def held(self) -> int:
        """Hand-offs waiting for the engine's schedule (`ahead`)."""
        return len(self._held) if self._held is not None else 0

    @property
    def runs_ahead(self) -> bool:
        """Whether `ahead` may wait (a P/D cluster's shared link); elsewhere it does nothing."""
        return bool(getattr(self.cluster, "shares_link", False))

    def ahead(self, t: float):
        """Under async output, before a schedule at `t` ahead of SimPy's clock (the start of a batch that
        waits for the one in flight): in a P/D cluster, whose replicas poll and post reads on one shared
        link, let every normal event before or at `t` happen first (another replica's read that starts
        meanwhile moves this one's end), holding this replica's hand-offs meanwhile: the schedule was
        chosen before they came (vLLM's engine schedules the next batch while the last runs), so they
        reach the engine after it (`release`), at their own times, as a lone engine takes them. A
        cluster without a link runs ahead as a lone engine does (a SimPy generator: `yield from`)."""
        env = self.env
        if not getattr(self.cluster, "shares_link", False) or env.peek() > t:
            return
        self._held = []
        yield _Late(env, t - env.now)

    def release(self) -> None:
        """The schedule `ahead` waited for is chosen: the hand-offs held meanwhile reach the engine."""
        held, self._held = self._held, None
        for req, t in held or ():
            self.admit(req, t)

    def poke(self, at: float | None = None) -> None:
        """Wake the engine if it sleeps on `wait()` or `idle_wait()`; `at`: the poker's clock, which
        may run ahead of SimPy's (the woken engine goes on from there, not before)."""
        if at is not None and at > self._poked_at:
            self._poked_at = at
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    def done(self, req: Request, now: float) -> None:
        """`req` finished or was dropped at `now` on this replica."""
        self.cluster.finished(self.index, req, now)

    def idle(self) -> bool:
        return self.cluster.idle()

    def upto(self, t: float):
        """Let every normal event at or before `t` happen before the engine goes on at `t` (one
        wait at priority LATE; see the module docstring)."""
        env = self.env
        if env.peek() <= t:
            yield _Late(env, max(t - env.now, 0.0))

    def idle_wait(self, t0: float, until: float):
        """An empty step at `t0`, the connector's next transfer due at `until`: as a lone engine's
        front end (the next event before `until` may bring work), unless the cluster pokes its idle
        replicas when their work may change (`pokes_idle`, a P/D cluster: two idle replicas at the
        same time would otherwise wake each other for ever): then sleep until `until` or a poke, and
        let the normal events at the time woken happen first. Returns the clock."""
        env = self.env
        if not getattr(self.cluster, "pokes_idle", False):
            clock = min(until, max(env.peek(), t0))
            yield from self.upto(clock)
            return clock
        self._wake = env.event()
        yield self._wake if until == math.inf else self._wake | _Late(env, until - env.now)
        self._wake = None
        t = min(max(env.now, self._poked_at), until)  # not before the clock of whoever woke it
        yield _Late(env, t - env.now)
        return t

    def wait(self):
        """Sleep until the router hands this replica a request, or the cluster is idle."""
        self._wake = self.env.event()
        yield self._wake
        self._wake = None


class Cluster:
    """The cluster's front end and router over `len(managers)` engines on one environment (the
    router `cfg.router` names, or `router`).

    `received[i]` lists the requests replica i was handed with the time each reached it;
    `load_events` (`sim.cluster.load.LoadChanges`) the (time, replica, +1 or -1) changes of each
    replica's in-flight count as the router counts it (dispatched, then finished or dropped). A router that reads KV events
    (`reads_events`, with an `index`) gets each replica's batch `cfg.kv_event_delay` seconds after
    the step that produced it ended: every batch due by a pick is applied to its index before it.
    With `cfg.kv_events`, the same batches reach `kv_events` in the order (ts, replica, step)
    (`event_stream`, closed when the run ends)."""

    def __init__(self, env: simpy.Environment, workload: Iterable[Request], cfg: SimConfig, cost, managers: list,
                 progress: Callable[[int], None] | None = None, router: Router | None = None,
                 steps_files: list[Path] | None = None, keep_requests: bool = True,
                 kv_events: Callable[[EventBatch], None] | None = None, costs: list | None = None):
        self.env = env
        self.cfg = cfg
        n = len(managers)
        self.view = RouterView(n)
        self.router = router if router is not None else make_router(cfg.router, n, cfg.seed, cfg, managers[0].num_blocks)
        self.events = DelayedEvents(cfg.kv_event_delay, self.router.index, lambda: env.now) \
            if getattr(self.router, "reads_events", False) else None
        self._rows: dict[str, tuple[int, int]] = {}  # request id -> (replica, its row in that engine's log)
        self.view.prefilled = self._prefilled
        # (time, the request, or its id without `keep_requests`: a long run then keeps no token arrays)
        self.received: list[list[tuple[float, Request | str]]] = [[] for _ in range(n)]
        self.keep_requests = keep_requests
        self.load_events = LoadChanges()
        self.expected: dict[str, int] = {}  # request id -> prompt tokens the router expected its replica to hit
        self.progress = progress
        self.num_done = 0
        # as a lone engine's (`Engine.__init__`): a fixed step time runs sessions open loop
        closed = cfg.closed_loop_sessions and cfg.step_time is None
        self.front = Frontend(env, workload, self._route, load=cfg.load, closed_loop=closed)
        self.inlets: list[ReplicaFront] = []
        # each replica's own config and cost model (`SimConfig.replica_pools`: replicas that differ)
        configs = cfg.replica_configs() if cfg.replica_pools else [cfg] * n
        costs = costs if costs is not None else [cost] * n
        # one stream of every replica's batches: to the router, and to `kv_events` in order
        self.event_stream = EventStream(env, self.events.send if self.events is not None else None, kv_events)
        sink = self.event_stream.send if self.events is not None or kv_events is not None else None
        # with `steps_files`, each replica's steps table streams into its file (memory stays flat)
        self.engines = [Engine(env, None, engine_config(c) if self.events is not None else c, costs[i], m,
                               front=self._inlet, kv_events=sink, replica=i,
                               steps_file=None if steps_files is None else steps_files[i], steps_segment=STEP_SEGMENT)
                        for i, (c, m) in enumerate(zip(configs, managers, strict=True))]
        env.process(self._close_after_source())
        if getattr(self.router, "reads_metrics", False):  # no snapshots where no router reads them
            env.process(self._snapshots(cfg.router_metrics_interval))

    def _inlet(self, admit: Callable[[Request], None]) -> ReplicaFront:
        inlet = ReplicaFront(self, len(self.inlets), admit)
        self.inlets.append(inlet)
        return inlet

    def _route(self, req: Request) -> None:
        """A request reaches the cluster now: the router picks its replica, which gets it now."""
        now = self.env.now
        self.view.now = now
        if self.events is not None:
            self.events.apply_due(now)
        i = self.router.pick(req, self.view)
        if not 0 <= i < len(self.inlets):
            raise RuntimeError(f"router {self.cfg.router} picked replica {i} of {len(self.inlets)}")
        expected = getattr(self.router, "expected_tokens", None)  # a prefix-aware router's belief
        if expected is not None:
            self.expected[req.id] = expected
        self.view.dispatched[i] += 1
        self.received[i].append((now, req if self.keep_requests else req.id))
        self.load_events.add(now, i, 1)
        self._rows[req.id] = (i, len(self.engines[i].requests.ids))  # the row `hand` adds
        self.inlets[i].hand(req)

    def _prefilled(self, request_id: str) -> bool:
        """Whether the request's first token was out by now on its replica (the router hears of it
        as its response stream starts)."""
        replica, row = self._rows[request_id]
        t = self.engines[replica].requests.first_token[row]
        return t == t and t <= self.env.now  # NaN: not yet

    def finished(self, replica: int, req: Request, now: float) -> None:
        """A request finished (or was dropped) on `replica` at `now`: the router sees it at once,
        and its session's next turn may follow."""
        self.view.finished[replica] += 1
        if hasattr(self.router, "finished"):
            self.router.finished(req, replica)
        self.load_events.add(now, replica, -1)
        self.front.done(req, now)
        self.num_done += 1
        if self.progress is not None and self.num_done % PROGRESS_EVERY == 0:
            self.progress(self.num_done)
        if self.front.idle():
            self._close()

    def idle(self) -> bool:
        """No request will reach any replica again (every request was routed at its release)."""
        return self.front.idle()

    def _close(self) -> None:
        """No request will reach any replica again: wake the sleeping ones so they end."""
        for inlet in self.inlets:
            inlet.poke()

    def _close_after_source(self):
        while not self.front.source_done:
            yield from self.front.wait()
        if self.front.idle():
            self._close()

    def metrics(self, replica: int) -> EngineMetrics:
        """Replica `replica`'s engine metrics now, as vLLM's SchedulerStats reports them."""
        return engine_metrics(self.engines[replica])

    def _snapshots(self, interval: float):
        """The engine metrics the router sees, taken every `interval` seconds from time 0 until
        every replica has ended."""
        env, view = self.env, self.view
        k = 0
        while True:
            view.metrics = tuple(self.metrics(i) for i in range(len(self.engines)))
            view.metrics_time = env.now
            view.snapshots += 1
            if self.front.idle() and not any(e.process.is_alive for e in self.engines):
                return
            k = next_snapshot(env, k, interval, (view,))  # (ticks before the next event: counted, not taken)
            yield env.timeout(k * interval - env.now)  # (k * interval: no drift from summed floats)
