"""A P/D cluster: prefill replicas and decode replicas on one SimPy clock, each an exact engine with
vLLM 0.33's NIXL connector (`sim.engine.nixl`), a router per pool, a decider (`sim.cluster.deciders`)
and the network between them (`sim.cluster.link`).

One request's path (vLLM's P/D proxies and llm-d's routing sidecar; `tests/sim/cluster/test_pd.py`
works one through by hand):
1. it reaches the cluster (the lone engine's `Frontend`: arrivals, closed-loop sessions); the decode
   router picks its decode replica and the decider looks at what that replica's prefix index holds
   (llm-d's order; Dynamo's decides from the cache-hot decode replica's overlap and picks the decode
   replica once the prefill is done);
2. kept local, it runs on its decode replica as on any replica. Disaggregated, the prefill router
   picks a prefill replica, which runs it with `max_tokens` 1 (`with_max_tokens_one`); when that
   finishes, its blocks stay held (`request_finished`'s `delay_free_blocks`) and the request reaches
   its decode replica at once, as a remote-prefill request;
3. the decode replica admits it when the whole prompt's blocks fit (net of its local prefix hit and
   of other loads' reservations) and posts one read of the blocks past its hit: bytes from the
   prefill replica's NIC to its own, sharing both NICs with the other reads (`SharedLink`), each
   side's rank carrying its own bytes of every block (`sim.engine.nixl_tp.read_ranks`: an attention
   block at its page bytes, a Mamba group's state block at its conv and SSM state's);
4. the decode replica sees the read done at a step's poll and decodes; the prefill replica hears of
   it at its own next poll and frees the blocks into its prefix cache. A request the decode side
   drops before reading it lets the prefill side go at once. While the decode side holds a request,
   its heartbeats keep the lease (`kv_lease_duration`) from expiring (vLLM's NIXL heartbeats,
   `NixlBaseConnectorScheduler.on_new_request`), so the lease never ends a hold here.

Replicas 0..P-1 are the prefill pool and P..P+D-1 the decode pool; each pool's router sees its
replicas by their index in the pool. A decode replica also prefills what the decider keeps local:
llm-d's `both` pods, which its decode filter passes and its prefill filter does not.
"""

from __future__ import annotations

import math
import pathlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import simpy

from kvsim.kvcache.hashing import block_keys
from kvsim.sim.cluster.cluster import (
    ReplicaFront,
    engine_config,
    engine_metrics,
    next_snapshot,
    replica_ops,
)
from kvsim.sim.cluster.deciders import DECODE_FIRST, NEEDS_PREFILL_BUSY, decide
from kvsim.sim.cluster.kv_index import DelayedEvents
from kvsim.sim.cluster.link import SharedLink
from kvsim.sim.cluster.routers import RouterView, make_router
from kvsim.sim.engine.config import SimConfig
from kvsim.sim.engine.frontend import Frontend
from kvsim.sim.engine.loop import PROGRESS_EVERY, Engine
from kvsim.sim.engine.metrics import STATUS, codes, percentiles, slo_figures
from kvsim.sim.engine.nixl import BlockBytes, NixlConnector, prefill_backoff, with_max_tokens_one
from kvsim.sim.engine.nixl_tp import read_ranks
from kvsim.sim.engine.run import RunResult, engine_result, make_manager, rare_collections
from kvsim.workloads.request import Request

NAN = math.nan


@dataclass(slots=True)
class Path:
    """One request's way through the cluster (times in seconds; NaN: not reached)."""

    arrival: float
    decode: int = -1  # the decode replica (its index in the cluster)
    prefill: int = -1  # the prefill replica, if disaggregated
    cached_tokens: int | None = None  # what the decider was told the decode replica holds
    prefill_done: float = NAN  # the prefill replica's token (the request reaches its decode replica)
    read_post: float = NAN
    read_bytes: int = 0  # a decode rank's bytes of the blocks read (past its local hit), each at its kind's
    read_end: float = NAN
    released: float = NAN  # the prefill replica freed its held blocks (it polled once the read ended)
    rows: dict[int, int] = field(default_factory=dict)  # replica -> the request's row in its log


class ClusterTransport:
    """What a replica's NIXL connector asks the cluster: which requests are remote, and when reads end."""

    def __init__(self, pd_cluster: PDCluster, replica: int):
        self.pd = pd_cluster
        self.replica = replica

    def remote_prefill(self, rid: str) -> bool:
        return rid in self.pd.remote_prefill[self.replica]

    def remote_decode(self, rid: str) -> bool:
        return rid in self.pd.remote_decode[self.replica]

    def post(self, rid: str, blocks: int, states: int, at: float) -> None:
        path = self.pd.paths[rid]
        path.read_post = at
        per_rank = self.pd.read_ranks.of(blocks, states)
        path.read_bytes = per_rank.receive
        self.pd.link.start(rid, path.prefill, self.replica, per_rank.send, at,
                           per_rank.receive / per_rank.send if per_rank.send else 1.0)
        self.pd.poke_idle(at)  # every read's end may move

    def read_end(self, rid: str, now: float) -> float | None:
        link = self.pd.link
        link.advance(now)
        return link.done_at(rid)

    def read_eta(self, rid: str) -> float:
        """The link's next end, whichever read it is: ends free bandwidth, so this read's end moves
        earlier then, with no event of its own; the replica looks again at each."""
        end = self.pd.link.next_end()
        return self.pd.link.eta(rid) if end is None else min(end, self.pd.link.eta(rid))

    def read_seen(self, rid: str) -> None:
        path = self.pd.paths[rid]
        path.read_end = self.pd.link.done_at(rid)
        if path.released == path.released:  # both sides are done with the read
            self.pd.link.forget(rid)

    def dropped(self, rid: str, now: float) -> None:
        self.pd.unread[rid] = now
        self.pd.poke_idle(now)  # its prefill replica lets it go

    def release_at(self, rid: str, finished: float, blocks: int, states: int, now: float) -> float | None:
        pd_ = self.pd
        pd_.link.advance(now)
        end = pd_.link.done_at(rid)
        if end is None:
            end = pd_.unread.get(rid)
        return end

    def freed(self, rid: str, now: float) -> None:
        path = self.pd.paths[rid]
        path.released = now
        if path.read_end == path.read_end:  # both sides are done with the read
            self.pd.link.forget(rid)

    def release_bound(self, rid: str, finished: float) -> float:
        """The link's next end (the read of `rid` may be it), or never: the read is not posted yet, the
        replica sleeps until a read starts (a poke). The lease does not end a hold while the decode
        side holds the request: its heartbeats renew it."""
        end = self.pd.link.next_end()
        return math.inf if end is None else end


class PDCluster:
    """`cfg.prefill_replicas` prefill and `cfg.decode_replicas` decode engines over `managers` (that
    many, prefill first), a router of `cfg.router` per pool and the decider `cfg.pd_decider`; each
    pool's engines run under its own config (`SimConfig.pool_config`) and cost model (`costs`:
    prefill, decode)."""

    def __init__(self, env: simpy.Environment, workload: Iterable[Request], cfg: SimConfig, costs: tuple,
                 managers: list, progress: Callable[[int], None] | None = None, steps_files: list | None = None):
        self.env = env
        self.cfg = cfg
        self.num_prefill = P = cfg.prefill_replicas
        D = cfg.decode_replicas
        if len(managers) != P + D:
            raise ValueError(f"{len(managers)} managers for {P} prefill and {D} decode replicas")
        self.routers = (make_router(cfg.router, P, cfg.seed, cfg, managers[0].num_blocks),
                        make_router(cfg.router, D, cfg.seed + 1, cfg, managers[P].num_blocks))
        self.views = (RouterView(P), RouterView(D))
        self.views[0].prefilled = self._prefilled
        self.views[1].prefilled = self._prefilled
        self.link = SharedLink(cfg.kv_transfer_gbps, cfg.kv_transfer_latency)
        pools = (cfg.pool_config("prefill"), cfg.pool_config("decode"))
        self.prefill_token_capacity = pools[0].batch_limits()[0]  # a prefill replica's max_num_batched_tokens
        self.block_bytes = tuple(BlockBytes.of(c) for c in costs)  # prefill's, decode's
        self.read_ranks = read_ranks(pools[0].tensor_parallel, self.block_bytes[0], costs[0].block_size,
                                     pools[1].tensor_parallel, self.block_bytes[1], costs[1].block_size)
        self.remote_prefill: list[set[str]] = [set() for _ in range(P + D)]
        self.remote_decode: list[set[str]] = [set() for _ in range(P + D)]
        self.unread: dict[str, float] = {}
        self.paths: dict[str, Path] = {}
        self._originals: dict[str, Request] = {}
        self.progress = progress
        self.num_done = 0
        closed = cfg.closed_loop_sessions and cfg.step_time is None
        self.front = Frontend(env, workload, self._route, load=cfg.load, closed_loop=closed)
        self.inlets: list[ReplicaFront] = []
        reads = tuple(getattr(r, "reads_events", False) for r in self.routers)
        self.events = tuple(DelayedEvents(cfg.kv_event_delay, r.index, lambda: env.now) if on else None
                            for r, on in zip(self.routers, reads, strict=True))
        self.engines: list[Engine] = []
        priority = cfg.scheduling == "priority"
        # each pool's `_prefill_backoff`, from its own model's layout
        self.backoffs = tuple(prefill_backoff(c) for c in costs)
        for i, m in enumerate(managers):
            pool = 0 if i < P else 1
            ev, cost, pool_cfg = self.events[pool], costs[pool], pools[pool]
            conn = NixlConnector(m, priority, ClusterTransport(self, i), self.block_bytes[pool], self.backoffs[pool])
            self.engines.append(Engine(env, None, engine_config(pool_cfg) if ev is not None else pool_cfg, cost, m,
                                       front=self._inlet, kv_events=ev.send if ev is not None else None,
                                       replica=i - P * pool, connector=conn,
                                       steps_file=None if steps_files is None else steps_files[i]))
        env.process(self._close_after_source())
        if any(getattr(r, "reads_metrics", False) for r in self.routers):
            env.process(self._snapshots(cfg.router_metrics_interval))

    pokes_idle = True  # idle replicas sleep until their transfer or a poke (`ReplicaFront.idle_wait`)
    shares_link = True  # the replicas poll and post reads on one link (an async schedule waits: `ReplicaFront.ahead`)

    def poke_idle(self, at: float) -> None:
        """Wake the replicas idling on transfers: the link's reads or a release changed at `at`."""
        for inlet in self.inlets:
            inlet.poke(at)

    def _inlet(self, admit: Callable[[Request], None]) -> ReplicaFront:
        inlet = ReplicaFront(self, len(self.inlets), admit)
        self.inlets.append(inlet)
        return inlet

    # ------------------------------------------------------------- routing
    def _pick(self, pool: int, req: Request) -> tuple[int, int | None]:
        """The replica (its cluster index) pool `pool`'s router picks for `req` now, and the prefix
        tokens the router expects it to hold (None: the router keeps no prefix index)."""
        router, view = self._heard(pool)
        i = router.pick(req, view)
        if not 0 <= i < view.num_replicas:
            raise RuntimeError(f"router {self.cfg.router} picked replica {i} of {view.num_replicas}")
        view.dispatched[i] += 1
        return i + (self.num_prefill if pool else 0), getattr(router, "expected_tokens", None)

    def _route(self, req: Request) -> None:
        """A request reaches the cluster now: pick, decide, hand it to its first replica."""
        cfg, now = self.cfg, self.env.now
        path = self.paths[req.id] = Path(now)
        self._originals[req.id] = req
        if DECODE_FIRST[cfg.pd_decider]:
            path.decode, path.cached_tokens = self._pick(1, req)
        else:
            path.cached_tokens = self._hottest_decode(req)
        busy = self._prefill_busy(req) if cfg.pd_decider in NEEDS_PREFILL_BUSY else None
        if not decide(cfg.pd_decider, req.prompt_len, path.cached_tokens, threshold=cfg.pd_threshold,
                      prefill_busy=busy).disaggregate:
            if path.decode < 0:
                path.decode, _ = self._pick(1, req)
            self._hand(path.decode, req)
            return
        path.prefill, _ = self._pick(0, req)
        self.remote_decode[path.prefill].add(req.id)
        self._hand(path.prefill, with_max_tokens_one(req, self.backoffs[0]))

    def _heard(self, pool: int) -> tuple[Any, RouterView]:
        """Pool `pool`'s router and view as of now: the view's clock set, its index fed the KV events
        due by now."""
        router, view, events = self.routers[pool], self.views[pool], self.events[pool]
        view.now = self.env.now
        if events is not None:
            events.apply_due(view.now)
        return router, view

    def _prefill_busy(self, req: Request) -> bool | None:
        """Whether the prefill replica the prefill router would pick for `req` now is busy: its active
        prefill tokens, as that router counts them, above `pd_busy_threshold` x its max_num_batched_tokens
        (Dynamo's `peek_prefill_chosen_worker_busy`); None without a signal (no threshold, or a router
        keeping no prefill-token count)."""
        if self.cfg.pd_busy_threshold is None or not hasattr(self.routers[0], "peek"):
            return None
        router, view = self._heard(0)
        i = router.peek(req, view)
        return router.prefill_tokens[i] > self.cfg.pd_busy_threshold * self.prefill_token_capacity

    def _hottest_decode(self, req: Request) -> int | None:
        """The decode replicas' largest prefix overlap with `req`, as the decode router's KV-event index
        knows it (Dynamo's `decode_chosen_overlap_blocks` x block size); None without an index."""
        router = self.routers[1]
        index = getattr(router, "index", None)
        if index is None or not hasattr(index, "overlaps"):
            return None
        events = self.events[1]
        if events is not None:
            events.apply_due(self.env.now)
        overlaps = index.overlaps(block_keys(req.prompt, self.cfg.block_size))
        return max(overlaps, default=0) * self.cfg.block_size

    def _hand(self, replica: int, req: Request) -> None:
        inlet = self.inlets[replica]
        self.paths[req.id].rows[replica] = len(self.engines[replica].requests.ids) + inlet.held
        inlet.hand(req)

    def _prefilled(self, rid: str) -> bool:
        """Whether the request's first token is out by now on the replica running it last."""
        path = self.paths[rid]
        replica = path.decode if path.decode >= 0 and path.decode in path.rows else path.prefill
        log, row = self.engines[replica].requests, path.rows[replica]
        if row >= len(log.ids):  # held until its replica's schedule (`ReplicaFront.ahead`): none yet
            return False
        t = log.first_token[row]
        return t == t and t <= self.env.now

    # ------------------------------------------------------------- leaving
    def finished(self, replica: int, req: Request, now: float) -> None:
        """A request finished (or was dropped) on `replica` at `now`: from a prefill replica it goes on
        to its decode replica; from a decode replica it is done."""
        pool = 0 if replica < self.num_prefill else 1
        local = replica - (self.num_prefill if pool else 0)
        self.views[pool].finished[local] += 1
        router = self.routers[pool]
        if hasattr(router, "finished"):
            router.finished(req, local)
        path = self.paths[req.id]
        if pool == 0:
            original = self._originals[req.id]
            log = self.engines[replica].requests
            path.prefill_done = now
            if log.status[path.rows[replica]] == 1:  # finished: its KV goes to the decode side
                self._at(now, lambda: self._to_decode(original))
                return
            req = original  # dropped by the prefill replica: the request is done
        self._originals.pop(req.id, None)
        self.front.done(req, now)
        self.num_done += 1
        if self.progress is not None and self.num_done % PROGRESS_EVERY == 0:
            self.progress(self.num_done)
        if self.idle():
            self._close()

    def idle(self) -> bool:
        """No request will reach any replica again: every request released and none on its way (a
        prefilled request still goes to its decode replica)."""
        return self.front.idle() and not self._originals

    def _at(self, t: float, action: Callable[[], None]) -> None:
        """Do `action` at time `t` on SimPy's clock: a replica's clock runs ahead of it, and another
        replica must not see what it hands on before then."""
        event = self.env.timeout(max(t - self.env.now, 0.0))
        event.callbacks.append(lambda _: action())

    def _to_decode(self, req: Request) -> None:
        """A prefilled request reaches its decode replica (picked now, Dynamo's order, if not yet)."""
        path = self.paths[req.id]
        if path.decode < 0:
            path.decode, _ = self._pick(1, req)
        self.remote_prefill[path.decode].add(req.id)
        self._hand(path.decode, req)

    def _close(self) -> None:
        for inlet in self.inlets:
            inlet.poke()

    def _close_after_source(self):
        while not self.front.source_done:
            yield from self.front.wait()
        if self.idle():
            self._close()

    def _snapshots(self, interval: float):
        """Each pool's engine metrics as its router sees them, every `interval` seconds."""
        env, k = self.env, 0
        while True:
            for pool, view in enumerate(self.views):
                first = self.num_prefill if pool else 0
                view.metrics = tuple(engine_metrics(self.engines[first + i]) for i in range(view.num_replicas))
                view.metrics_time = env.now
                view.snapshots += 1
            if self.idle() and not any(e.process.is_alive for e in self.engines):
                return
            k = next_snapshot(env, k, interval, self.views)  # (ticks before the next event: counted, not taken)
            yield env.timeout(k * interval - env.now)

    # ------------------------------------------------------------- results
    def paths_frame(self) -> pd.DataFrame:
        """A row a request: its replicas, and the times of its way through them (TTFT's parts)."""
        rows = []
        for rid, p in self.paths.items():
            d = self.engines[p.decode].requests if p.decode in p.rows else None
            dr = p.rows.get(p.decode)
            pr = p.rows.get(p.prefill)
            plog = self.engines[p.prefill].requests if pr is not None else None
            rows.append({
                "id": rid, "arrival": p.arrival, "remote": p.prefill >= 0, "prefill_replica": p.prefill,
                "decode_replica": p.decode, "cached_tokens": p.cached_tokens,
                "prefill_start": plog.first_scheduled[pr] if plog is not None else NAN,
                "prefill_done": p.prefill_done, "read_post": p.read_post, "read_end": p.read_end, "read_bytes": p.read_bytes,
                "released": p.released,
                "decode_start": d.first_scheduled[dr] if d is not None else NAN,
                "first_token": d.first_token[dr] if d is not None else NAN,
                "finish": d.finish[dr] if d is not None else (p.prefill_done if pr is not None else NAN),
                "output_len": int(d.output_len[dr]) if d is not None else 0,
                "status": STATUS[int(d.status[dr])] if d is not None else "rejected",
            })
        df = pd.DataFrame(rows)
        df["ttft"] = df["first_token"] - df["arrival"]
        decode = (df["output_len"] - 1).astype(np.float64)
        df["tpot"] = (df["finish"] - df["first_token"]) / decode.where(decode > 0)
        remote = df["remote"]
        df["prefill_queue"] = (df["prefill_start"] - df["arrival"]).where(remote)
        df["prefill"] = (df["prefill_done"] - df["prefill_start"]).where(remote)
        df["decode_queue"] = (df["read_post"] - df["prefill_done"]).where(remote)
        df["transfer"] = (df["read_end"] - df["read_post"]).where(remote)
        df["promotion"] = (df["decode_start"] - df["read_end"]).where(remote)
        df["hold"] = (df["released"] - df["prefill_done"]).where(remote)
        return df


def pd_summary(paths: pd.DataFrame, replicas: list[Any], cfg: SimConfig) -> dict[str, Any]:
    """The P/D section: the pools, how many requests went remote, TTFT and its parts, TPOT, goodput
    under the SLOs, the prefill side's held blocks and the bytes read."""
    done = codes(paths["status"], STATUS) == STATUS.index("finished")
    out: dict[str, Any] = {"prefill_replicas": cfg.prefill_replicas, "decode_replicas": cfg.decode_replicas,
                           "pools": {name: {"gpu": c.gpu, "tensor_parallel": c.tensor_parallel,
                                            "num_gpu_blocks": int(r.summary["num_gpu_blocks"])}
                                     for name, c, r in (("prefill", cfg.pool_config("prefill"), replicas[0]),
                                                        ("decode", cfg.pool_config("decode"), replicas[-1]))},
                           "router": cfg.router, "decider": cfg.pd_decider, "link_gbps": cfg.kv_transfer_gbps,
                           "async_scheduling": cfg.runs_async,
                           "requests": len(paths),
                           "finished": int(done.sum()), "remote": int(paths["remote"].sum())}
    for col in ("ttft", "tpot", "prefill_queue", "prefill", "decode_queue", "transfer", "promotion", "hold"):
        figures = percentiles(paths[col].to_numpy(dtype=np.float64, na_value=np.nan)[done], col)
        out.update({f"{col}_p50": figures[f"{col}_p50"], f"{col}_p99": figures[f"{col}_p99"],
                    f"{col}_mean": figures[f"{col}_mean"]})
    span = float(paths["finish"].max() - paths["arrival"].min()) if len(paths) else 0.0
    out["duration_s"] = span
    out.update(slo_figures(paths, cfg.slo_ttft, cfg.slo_tpot, span))
    gpus = cfg.num_gpus()
    out["gpus"] = gpus
    out["goodput_rps_per_gpu"] = out["goodput_rps"] / gpus if out["goodput_rps"] is not None else None
    out["read_bytes"] = int(sum(r.summary.get("read_bytes", 0) for r in replicas))
    out["held_block_seconds"] = float(sum(r.summary.get("held_block_seconds", 0.0) for r in replicas))
    return out


@dataclass
class PDResult:
    """A P/D cluster's run: each replica's result (prefill pool first), a row a request with its way
    through the pools (`PDCluster.paths_frame`), and the `pd` summary section."""

    config: SimConfig
    workload: str
    replicas: list[RunResult]
    paths: pd.DataFrame
    summary: dict[str, Any]


def simulate_pd(workload: Iterable[Request], cfg: SimConfig, progress: Callable[[int], None] | None = None, *,
                cost_model: Any = None, ops_dir: str | pathlib.Path | None = None) -> PDResult:
    """Replay `workload` through the P/D cluster `cfg` describes (`prefill_replicas`, `decode_replicas`,
    `router` per pool, `pd_decider`, the link's `kv_transfer_gbps` and `kv_transfer_latency`);
    deterministic for a given workload and config. Each pool runs under its own config
    (`SimConfig.pool_config`: `prefill_pool`, `decode_pool`); `cost_model` is taken for a pool that sets
    nothing apart, and each other pool gets its own. With `cfg.record_ops` each replica records its op
    stream (a decode replica's reads as written when applied), kept, or streamed into `ops_dir`
    (`sim.cluster.cluster.replica_ops`)."""
    from kvsim.sim.engine.cost_model import CostModel

    cfg.validate()
    pools = (cfg.pool_config("prefill"), cfg.pool_config("decode"))
    costs = tuple(cost_model if cost_model is not None and not own else CostModel.from_config(c)
                  for c, own in zip(pools, (cfg.prefill_pool, cfg.decode_pool), strict=True))
    counts = (cfg.prefill_replicas, cfg.decode_replicas)
    managers = [make_manager(engine_config(pools[k]), costs[k]) for k in (0, 1) for _ in range(counts[k])]
    for m in managers:
        if m.sliding_window is not None:
            from kvsim.sim.engine.catalog import ConfigError

            raise ConfigError(f"prefill_replicas: {cfg.model}'s cache has one group with a sliding window; kvsim "
                              "models vLLM's NIXL connector over full attention or vLLM's hybrid groups")
    env = simpy.Environment()
    cluster = PDCluster(env, workload, cfg, costs, managers, progress)
    with rare_collections(), replica_ops(managers, ops_dir):
        env.run()
    if progress is not None:
        progress(cluster.num_done)
    name = getattr(workload, "name", "workload")
    skipped = getattr(workload, "skipped", 0)
    replicas = [engine_result(e, pools[i >= cfg.prefill_replicas], costs[i >= cfg.prefill_replicas], name, skipped)
                for i, e in enumerate(cluster.engines)]
    paths = cluster.paths_frame()
    return PDResult(cfg, name, replicas, paths, {"workload": name, "model": cfg.model, "gpu": cfg.gpu,
                                                 "pd": pd_summary(paths, replicas, cfg)})


# the P/D section's figures a sweep or a rate search records a P/D point by, under the names one
# engine's summary gives the same figures
PD_FIGURES = ("requests", "finished", "remote", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "goodput_rps",
              "slo_attainment", "duration_s", "gpus", "goodput_rps_per_gpu", "transfer_mean", "hold_mean",
              "read_bytes")


def pd_figures(summary: dict[str, Any]) -> dict[str, Any]:
    """A P/D run's summary as one flat record (scalars only): what ran and `PD_FIGURES`."""
    section = summary["pd"]
    return {"workload": summary["workload"], "model": summary["model"], "gpu": summary["gpu"],
            "prefill_replicas": section["prefill_replicas"], "decode_replicas": section["decode_replicas"],
            "router": section["router"], "decider": section["decider"], **{k: section[k] for k in PD_FIGURES}}
