"""The simulated inference engine: two SimPy processes around one scheduler.

Scenario: requests stream in from a workload at their arrival times (the
`arrivals` process; closed-loop session turns are released `think_time`
after the previous turn finished). The `steps` process repeatedly asks the
scheduler for a batch, advances the clock by the cost model's step time,
applies the step, and logs it; with nothing to run it sleeps until the next
arrival instead of spinning.

With a fixed step time S (`SimConfig.step_time`, for step-by-step comparison
with vLLM) step k starts at k * S, every request that arrived at or before
k * S is queued before it (in arrival order; sessions are open loop then),
and an idle engine wakes on the first grid point at or after the next
arrival; steps are numbered by k.

The steps process is one loop for both output modes (`Engine._steps`): vLLM's batch queue,
one deep for the sync output mode and two deep for the async one (`sim.engine.output`: each
batch is scheduled while the previous one runs, and its output applied after it ends).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from operator import sub
from pathlib import Path
from typing import TYPE_CHECKING, Any

import simpy

from kvsim.kvcache.events import EventBatch
from kvsim.kvcache.invariants import check as check_invariants
from kvsim.kvcache.manager import KVCacheManager
from kvsim.kvcache.ops import CHARGED_KINDS
from kvsim.sim.engine.async_quiet import AsyncQuietRuns
from kvsim.sim.engine.config import ConfigError, SimConfig
from kvsim.sim.engine.frontend import Frontend
from kvsim.sim.engine.metrics import GroupUsage, RequestLog
from kvsim.sim.engine.quiet import QuietRuns
from kvsim.sim.engine.scheduler import Batch, Scheduler
from kvsim.sim.engine.step_log import StepLog
from kvsim.workloads.request import Request

if TYPE_CHECKING:
    from kvsim.sim.engine.cost_model import CostModel

PROGRESS_EVERY = 64  # report progress every this many requests done
STALL_STEPS = 1000  # async: consecutive empty batches with nothing running or in flight before giving up
# recompute or swap preemptions in a row with no token decoded and no request finished: the running and
# waiting requests preempt each other in a cycle that never ends (vLLM 0.33's scheduler cycles alike)
LIVELOCK_PREEMPTIONS = 50_000


class Stalled(RuntimeError):
    """The engine can make no more progress on its configuration: nothing is scheduled and nothing
    will arrive, or requests preempt each other in a cycle. vLLM 0.33's scheduler stalls or cycles
    on the same configuration (`kvsim conform` checks that both sides do); the message says which."""


NO_OPS = dict.fromkeys(CHARGED_KINDS, 0)
_COUNTED = ("evict", *CHARGED_KINDS)  # the op counts a step records
_ZEROS = (0,) * len(_COUNTED)


def _counts(get: Callable[[str, int], int]) -> tuple[int, ...]:
    """The manager's evict count, then its counts of the kinds a step is charged for."""
    return tuple(map(get, _COUNTED, _ZEROS))


def grid_index(t: float, step_time: float) -> int:
    """The first step k whose start k * step_time is at or after `t` (exact in floats)."""
    k = max(math.ceil(t / step_time), 0)
    while k * step_time < t:
        k += 1
    while k > 0 and (k - 1) * step_time >= t:
        k -= 1
    return k


def step_row(t0: float, dt: float, sched: Scheduler, b: Batch, deltas: tuple[int, ...], done: int) -> tuple:
    """The steps table's row (`STEP_FIELDS` order) of batch `b`, which ran from `t0` for `dt` seconds
    and whose output is applied: queues and blocks as they are now; `deltas`: the step's evict count,
    then its counts of `CHARGED_KINDS`; `done`: requests done. (Quiet runs write the same row for a
    step of decodes from their own counters: `sim.engine.quiet`.)"""
    m = sched.m
    free = m.num_free_blocks
    return (
        t0, dt, len(sched.running), len(sched.waiting), len(sched.swapped), b.num_seqs,
        b.prefill_tokens, b.decode_tokens, b.context_tokens,
        free, m.num_cached_free_blocks, m.num_usable_blocks - free,
        m.id_space_fragmentation(), sched.internal_fragmentation,
        deltas[0], b.preempted_recompute, b.preempted_swap, *deltas[1:],
        b.admitted, b.admitted_prompt_tokens, b.admitted_hit_tokens, done,
    )  # fmt: skip


def build_scheduler(cfg: SimConfig, manager: KVCacheManager, log: RequestLog, cost: CostModel,
                    connector: Any = None) -> Scheduler:
    """The scheduler `cfg` asks for, with its KV connector (offloading's, with `kv_offloading_size`; the
    NIXL connector of P/D disaggregation, with `kv_transfer_role`);
    the scheduler builds its output mode (sync or async) and prefill rules from `cfg` itself. A
    `connector` given (a P/D cluster's replica, `sim.cluster.pd`) is used as it is."""
    if connector is None and cfg.kv_offloading_size is not None:
        from kvsim.sim.engine.offload_connector import OffloadConnector

        if manager.sliding_window is not None:
            raise ConfigError(f"kv_offloading_size: {cfg.model} uses a sliding window; offloading is "
                              "modelled for full attention only")
        per_block = (cost.op_cost_s["load"], cost.op_cost_s["store"])
        connector = OffloadConnector.build(cfg, manager, cost.kv_bytes_per_block, per_block)
    elif connector is None and cfg.kv_transfer_role is not None:
        from kvsim.sim.engine.nixl import (
            BlockBytes,
            KVTransfer,
            LoneTransport,
            NixlConnector,
            prefill_backoff,
        )

        if manager.sliding_window is not None:
            raise ConfigError(f"kv_transfer_role: {cfg.model} uses a sliding window; kvsim models vLLM's NIXL "
                              "connector for full attention only (vLLM clips a window's blocks)")

        block_bytes = BlockBytes.of(cost)
        transfer = KVTransfer(block_bytes, cfg.kv_transfer_gbps, cfg.kv_transfer_latency)
        transport = LoneTransport(transfer, cfg.kv_transfer_role, cfg.kv_lease_duration)
        backoff = prefill_backoff(cost)
        connector = NixlConnector(manager, cfg.scheduling == "priority", transport, block_bytes, backoff)
    return Scheduler(cfg, manager, log, connector=connector)


class Engine:
    """An arrival process and a step process sharing one scheduler, cost model and logs."""

    def __init__(
        self,
        env: simpy.Environment,
        workload: Iterable[Request] | None,
        cfg: SimConfig,
        cost: CostModel,
        manager: KVCacheManager,
        progress: Callable[[int], None] | None = None,
        steps_file: str | Path | None = None,
        front: Callable[[Callable[[Request], None]], Frontend] | None = None,
        kv_events: Callable[[EventBatch], None] | None = None,
        replica: int = 0,
        connector: Any = None,
        steps_segment: int | None = None,
    ):
        self.env = env
        self.cfg = cfg
        self.cost = cost
        self.m = manager
        self.requests = RequestLog()
        self.steps = StepLog(steps_file, steps_segment)  # with a file: streamed into it, a segment at a time
        # vLLM's hybrid KV-cache groups: the blocks each holds after each step (blocks.png)
        self.group_usage = GroupUsage(manager.num_groups) if getattr(manager, "num_groups", 1) > 1 else None
        self.sched = build_scheduler(cfg, manager, self.requests, cost, connector)
        # NOTE: a fixed step time is for step-by-step comparison with vLLM, which sees every
        # request at its arrival time: open loop
        closed = cfg.closed_loop_sessions and cfg.step_time is None
        self.progress = progress
        self.num_done = 0
        # vLLM's KV events (a manager built with kv_events): handed on once a step, stamped with `replica`
        self.kv_events = kv_events if manager.emits_events else None
        self.replica = replica
        # a cluster's replica takes its requests from the router instead (`sim.cluster`): `front`
        # builds its front end around this engine's `admit`, and `workload` is not read
        if front is None:
            self.front = Frontend(env, workload, self.admit, load=cfg.load, closed_loop=closed)
        else:
            self.front = front(self.admit)
        self.process = env.process(self._steps())

    # ------------------------------------------------------------- arrivals
    def admit(self, req: Request, now: float | None = None) -> None:
        """The request reaches the engine now, or at `now` (a hand-off its front end held while the
        engine waited for its step's start: `ReplicaFront.ahead`)."""
        now = self.env.now if now is None else now
        self.sched.add(req, now)
        self._drain_done(now)

    def _drain_done(self, now: float) -> int:
        done = self.sched.done
        if not done:
            return 0
        for req in done:
            self.front.done(req, now)
        n = len(done)
        done.clear()
        self.num_done += n
        if self.progress is not None and self.num_done // PROGRESS_EVERY != (self.num_done - n) // PROGRESS_EVERY:
            self.progress(self.num_done)
        return n

    def _take_events(self, now: float, step: int) -> None:
        """The KV events the step queued, handed on as one batch if there are any (vLLM's
        `Scheduler.update_from_output` takes them once a step, the GPU pool's and then its KV
        connector's, and publishes a non-empty batch)."""
        events = self.m.take_events()
        connector = self.sched.connector
        if connector is not None:
            events += connector.take_events()
        if events:
            self.kv_events(EventBatch(now, self.replica, step, events))

    def _cycle(self, churn: int, t: float, step: int) -> str:
        """What `Stalled` says of a preemption cycle: how long, and the requests caught in it."""
        sched = self.sched
        caught = [*sched.running[:4], *([sched.waiting.peek()] if sched.waiting else [])]
        names = ", ".join(dict.fromkeys(x.req.id for x in caught))
        return (f"scheduler made no progress: {churn:,} preemptions in a row with no token decoded and no request "
                f"finished, up to t={t:.6f}s (step {step}); requests {names} preempt each other in a cycle, as "
                "vLLM 0.33's scheduler does on this configuration: give more --num-gpu-blocks or a larger "
                "--max-num-batched-tokens")

    # ---------------------------------------------------------------- steps
    def _steps(self):
        """vLLM's EngineCore busy loop (`step_with_batch_queue`, vllm/v1/engine/core.py) over either
        output mode: the batch queue is one deep (sync: schedule, run, apply) or two (async: batch
        k + 1 is scheduled while batch k runs).

        Each pass schedules a batch if the scheduler has requests; unless the queue is then full or
        nothing is left to schedule it passes again, else it pops the oldest batch, lets the clock
        reach that batch's end (requests that arrive meanwhile are queued first), and applies its
        output. A batch that runs starts when the device is free, max(clock, previous end), and
        lasts its cost-model time or one grid slot (`SimConfig.step_time`: clock values are then
        slot numbers, and every arrival up to a step's slot is queued before it). Steps are
        numbered by grid slot, or by batches run so far. Where the two modes differ, vLLM's do:
        - with nothing to run (a batch that neither ran tokens nor preempted), sync waits for
          the connector's next transfer or an arrival (`Scheduler.idle_until`), and async spins
          one empty step while no batch is in flight;
        - a sync batch that only preempted still takes a step (its swaps are charged); sync stops
          when no request is left (`has_work`), async also steps for finished ones (`has_requests`);
        - sync takes quiet runs of decode-only steps (`sim.engine.quiet`), async its own of steps of
          lazy decodes alone (`sim.engine.async_quiet`);
        - async chooses a batch at its start, which may lie ahead of SimPy's clock: a P/D cluster's
          replica first lets the other replicas reach it (`ReplicaFront.ahead`: they share a link).
        Mirrored over vLLM's own scheduler by `sim.conform.vllm_timed`.
        """
        env, m, sched, cost, cfg = self.env, self.m, self.sched, self.cost, self.cfg
        count = m.op_counts.get  # NOTE: not [...]: a missing key would call Counter.__missing__
        record = self.steps.record
        usage = self.group_usage
        defrag = cfg.defrag_threshold is not None
        check = check_invariants if cfg.debug_invariants else None
        S = cfg.step_time
        grid = S is not None
        sync = not sched.output.overlaps
        depth = 1 if sync else 2
        busy = sched.has_work if sync else sched.has_requests
        quiet = QuietRuns.build(cfg, sched, env, cost, self.steps, self._drain_done, usage,
                                self._take_events if self.kv_events is not None else None)
        # a P/D cluster's replica under async output: the step's schedule polls the shared link at the
        # batch's start, ahead of the clock, so it first lets every other replica reach that time
        # (`ReplicaFront.ahead`: its own hand-offs meanwhile wait for the schedule, as they would)
        ahead = None if sync else getattr(self.front, "ahead", None)
        # the async output's steps of lazy decodes alone, in a loop of their own
        lazy_runs = None if sync else AsyncQuietRuns.build(
            cfg, sched, env, cost, self.steps, lambda: _counts(count), step_row, self.front.upto, self._drain_done,
            usage, events=self._take_events if self.kv_events is not None else None, ahead=getattr(self.front, "runs_ahead", ahead is not None))

        def at(x: float) -> float:  # a clock value (a grid slot, or seconds) as seconds
            return x * S if grid else x

        spin = 1 if grid or sync else cost.step_time(0, 0, 0, 0, NO_OPS)  # (only async spins)
        queue: deque[tuple] = deque()  # (batch, start, end, seconds, step, op deltas, drops); start None: no forward
        clock = 0 if grid else env.now
        free = clock  # when the device is next free
        k = 0  # batches run so far
        prev = _ZEROS  # the op counts when the last batch that ran was scheduled
        empties = 0
        churn = 0  # preemptions since a batch last decoded a token or a request last finished
        # NOTE: on the cost clock the engine yields to SimPy only when an event falls before the
        # clock, or to sleep: back-to-back steps cost no event each
        while True:
            if grid:
                yield from self.front.upto(at(clock))
            if not queue and not busy():
                if at(clock) > env.now:  # catch up first: an arrival may be due meanwhile
                    yield env.timeout(at(clock) - env.now)
                    continue
                if self.front.idle():
                    break
                yield from self.front.wait()
                clock = max(clock, grid_index(env.now, S) if grid else env.now)
                continue
            if sched.has_requests():
                # steps that only decode, in a loop of their own (with the NIXL connector, beside reads in
                # flight too: a run stops before any step whose poll could see one done, `next_change`)
                if quiet is not None and sched.running:
                    clock, k, prev = yield from quiet.run(clock, k, prev)
                if lazy_runs is not None and lazy_runs.ready(queue):
                    clock, free, k, prev, taken = yield from lazy_runs.run(queue, clock, free, k, prev)
                    if taken:  # (each decoded a token) the loop decides afresh from its top
                        churn = empties = 0
                        continue
                start = max(free, clock)
                step = start if grid else k
                sched.step = step
                m.set_step(step)
                if defrag:  # NOTE: lazy decodes' writes are recorded before blocks move
                    m.defragment(sched.materialize if m.records_ops else None)
                waits = ahead is not None and at(start) > env.now
                if waits:
                    yield from ahead(at(start))
                b = sched.schedule(at(start))
                if waits:
                    self.front.release()
                dropped = self._drain_done(at(start)) if sched.done else 0
                if b.decode_tokens:
                    churn = 0
                elif b.preempted_recompute or b.preempted_swap:
                    churn += b.preempted_recompute + b.preempted_swap
                    if churn >= LIVELOCK_PREEMPTIONS:
                        raise Stalled(self._cycle(churn, at(start), step))
                if b.num_seqs or (sync and (b.preempted_recompute or b.preempted_swap)):
                    now = _counts(count)
                    deltas = tuple(map(sub, now, prev))
                    prev = now
                    if grid:
                        end = start + 1
                        dt = at(end) - at(start)
                    else:
                        ops = NO_OPS if deltas[1:] == _ZEROS[1:] else dict(zip(CHARGED_KINDS, deltas[1:], strict=True))
                        dt = cost.step_time(b.prefill_tokens, b.decode_tokens, b.context_tokens, b.num_seqs, ops,
                                            b.chunks)
                        end = start + dt
                    free = end
                    k += 1
                    empties = 0
                    sched.launched(b, at(end))
                    queue.appendleft((b, start, end, dt, step, deltas, dropped))
                elif sync:
                    # NOTE: only transfers to the host tier (sim.engine.offload) let a step do nothing:
                    # the engine steps again once one is applied
                    t0 = at(start)
                    until = sched.idle_until(t0) if sched.has_work() else t0
                    if until is None:
                        raise Stalled(f"scheduler made no progress at t={t0:.6f}s (step {step})")
                    if self.kv_events is not None:  # vLLM applies an empty step's output too
                        self._take_events(t0, step)
                    if grid:  # an empty step takes its slot; none polls before the transfer ends
                        clock = start + 1 if until <= t0 else max(grid_index(min(until, env.peek()), S), start + 1)
                    elif until > t0:  # nothing landed: wait for the transfer, or an arrival before it
                        clock = yield from self.front.idle_wait(t0, until)
                    continue
                else:
                    empties = 0 if sched.in_flight(b.start) else empties + 1  # (a transfer lands later)
                    if empties >= STALL_STEPS:
                        raise Stalled(f"scheduler made no progress for {empties} batches at t={at(clock):.6f}s")
                    if all(q[1] is None for q in queue):
                        clock += spin  # nothing running: the engine spins
                        if not grid:
                            yield from self.front.upto(clock)
                    sched.launched(b, b.start)  # no forward
                    queue.appendleft((b, None, None, 0.0, step, _ZEROS, dropped))
                if len(queue) < depth and (b.num_seqs or sched.has_requests()):
                    continue
            b, start, end, dt, step, deltas, dropped = queue.pop()
            if start is None:
                sched.update(b, b.start)  # nothing ran (no forward); the scheduler only hears of it
                if self.kv_events is not None:
                    self._take_events(b.start, step)
                continue
            clock = max(clock, end)
            if env.peek() <= at(clock):  # arrivals while it ran are queued before its output
                yield from self.front.upto(at(clock))
            sched.step = step
            m.set_step(step, output=True)
            sched.update(b, at(end))
            if self.kv_events is not None:
                self._take_events(at(end), step)
            done = dropped + (self._drain_done(at(end)) if sched.done else 0)
            if done:
                churn = 0
            record(step_row(at(start), dt, sched, b, deltas, done))
            if usage is not None:
                usage.add(m.held)
            if check is not None:
                check(m)
                sched.materialize()  # lazy decodes' sequences lag; the check reads them
                exact = m.internal_fragmentation([x.seq for x in sched.running])
                if sched.internal_fragmentation != exact:
                    raise AssertionError(f"step {step}: internal fragmentation {sched.internal_fragmentation} "
                                         f"!= {exact}")
        if self.progress is not None:
            self.progress(self.num_done)
