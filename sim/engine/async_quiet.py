"""Async quiet runs: under the async output, steps at which every running sequence decodes lazily,
taken back to back in a loop of their own (an exact shortcut behind `SimConfig.shortcuts`).

A lightly loaded engine spends most of its steps so: one or a few requests running, each decoding
inside its last block (`sim.engine.shortcuts.AsyncLazy`), nothing waiting. Such a step's schedule is
the lazy totals alone (`Scheduler.lazy_batch`, what `schedule` gives when its RUNNING pass visits no
one), and the output of a batch made so applies nothing: no member samples, caches or finishes, and
the internal fragmentation is the lazy sums' (`AsyncLazy.applied_slots`). `AsyncQuietRuns.run` keeps
the engine's two-deep batch queue as `Engine._steps` does (schedule step k, then apply step k - 1's
output at its end, arrivals queued first), and for such a pair builds the step's row from what it
knows (the pool's figures read once a run: a lazy step takes, frees and caches nothing), where the
general step would go through `schedule`, `update` and `step_row`. The first output a run applies,
a batch the general step scheduled, is applied as the general step applies it.

A step is taken here while, before it: every running sequence is lazy and none is due at it, the
budget holding their tokens (`Shortcuts.lazy_only`), WAITING and the
finished list are empty, and the batch in flight ran. An arrival while a batch runs is queued before
its output, as the general step queues it, and ends the run. Off with a fixed step time, defrag,
KV events (a step's batch of them is handed on by the general step), invariant checks, the prefill
cadence, Mamba chunking, a connector (the async lazy decodes run without one) and a P/D cluster's
replica (whose schedule first lets the others reach its start, `ReplicaFront.ahead`; other clusters'
replicas take runs, yielding where the general step yields); wherever the async output's lazy decodes
are off.

Measured (docs/benchmarks.md): 1,500 RAGPulse requests, about one running, 0.84x the wall time of
the general step; the Azure one-replica run (its WAITING never empty) unchanged.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from operator import sub
from typing import TYPE_CHECKING, Any

from kvsim.kvcache.ops import CHARGED_KINDS
from kvsim.sim.engine.config import SimConfig
from kvsim.sim.engine.scheduler import Scheduler

if TYPE_CHECKING:
    import simpy

    from kvsim.sim.engine.cost_model import CostModel
    from kvsim.sim.engine.metrics import GroupUsage
    from kvsim.sim.engine.step_log import StepLog

NO_OPS = dict.fromkeys(CHARGED_KINDS, 0)  # what a cost model is told a step without charged ops did


class AsyncQuietRuns:
    """One async engine's quiet runs: the scheduler, manager and logs they drive, and steps taken."""

    def __init__(self, sched: Scheduler, env: simpy.Environment, cost: CostModel, steps: StepLog,
                 counts: Callable[[], tuple[int, ...]], row: Callable[..., tuple], upto: Callable[[float], Any],
                 drain: Callable[[float], int], usage: GroupUsage | None):
        self.sched, self.env, self.cost, self.steps = sched, env, cost, steps
        self.counts = counts  # the manager's evict count, then its counts of CHARGED_KINDS (`loop._counts`)
        self.row = row  # the general step's row (`loop.step_row`), for the output it applies here
        self.upto = upto  # the front end's arrivals up to a time (`Frontend.upto`, a generator)
        self.drain = drain  # the engine's `_drain_done`
        self.usage = usage  # each group's blocks after each step (vLLM's hybrid groups), or None
        self.taken = 0  # steps taken so far

    @classmethod
    def build(cls, cfg: SimConfig, sched: Scheduler, env: simpy.Environment, cost: CostModel, steps: StepLog,
              counts: Callable[[], tuple[int, ...]], row: Callable[..., tuple], upto: Callable[[float], Any],
              drain: Callable[[float], int], usage: GroupUsage | None, *, events: bool, ahead: bool
              ) -> AsyncQuietRuns | None:
        """The runs for an engine's step loop, or None where they do not apply (module docstring)."""
        if not sched.fast.async_decodes or events or ahead or sched.prefill.cadence is not None or sched.mamba is not None:
            return None
        if cfg.step_time is not None or cfg.defrag_threshold is not None or cfg.debug_invariants:
            return None
        return cls(sched, env, cost, steps, counts, row, upto, drain, usage)

    def ready(self, queue: deque[tuple]) -> bool:
        """Whether the step about to be scheduled may start a run: one batch in flight, one that ran."""
        sched = self.sched
        return len(queue) == 1 and queue[0][1] is not None and not sched.waiting and not sched.done \
            and sched.fast.lazy_only(sched.steps_scheduled + 1, sched.max_tokens)

    def run(self, queue: deque[tuple], clock: float, free: float, k: int, prev: tuple[int, ...]):
        """Take steps while each may be taken here (see the module docstring), from the engine's
        state at the top of its loop: its batch queue (one batch in flight), clock, when the device
        is free, batches run, op counts at the last schedule. Returns those after the run and the
        steps taken (a generator: it yields to SimPy where an arrival falls before the clock)."""
        sched, m, env = self.sched, self.sched.m, self.env
        fast, record, step_time, counts = sched.fast, self.steps.record, self.cost.step_time, self.counts
        lazy, lazy_only = fast.lazy, fast.lazy_only
        running, waiting, swapped = sched.running, sched.waiting, sched.swapped
        max_tokens, usable, usage = sched.max_tokens, m.num_usable_blocks, self.usage
        zeros = (0,) * (len(prev) - 1)
        taken = 0
        pool = None  # (free, cached free, id-space fragmentation): read once a lazy output is applied
        while not waiting and not sched.done and lazy_only(sched.steps_scheduled + 1, max_tokens):
            start = free if free > clock else clock
            step = k
            sched.step = step
            m.set_step(step)
            b = sched.lazy_batch(start)
            now = counts()
            deltas = tuple(map(sub, now, prev))
            prev = now
            ops = NO_OPS if deltas[1:] == zeros else dict(zip(CHARGED_KINDS, deltas[1:], strict=True))
            dt = step_time(0, b.decode_tokens, b.context_tokens, b.lazy, ops, b.chunks)
            free = end = start + dt
            k += 1
            b_, start_, end_, dt_, step_, deltas_, dropped_ = queue.pop()
            queue.appendleft((b, start, end, dt, step, deltas, 0))
            if end_ > clock:
                clock = end_
            if env.peek() <= clock:  # arrivals while it ran are queued before its output
                yield from self.upto(clock)
            sched.step = step_
            m.set_step(step_, output=True)
            if taken and lazy.n == len(running):
                # a batch this run scheduled: its output applies nothing (`AsyncOutput.update`)
                frag = sched.internal_fragmentation = lazy.applied_slots(b_.k)
                if pool is None:
                    pool = (m.num_free_blocks, m.num_cached_free_blocks, m.id_space_fragmentation())
                n = b_.lazy
                record((start_, dt_, len(running), len(waiting), len(swapped), n, 0, n, b_.context_tokens,
                        pool[0], pool[1], usable - pool[0], pool[2], frag, deltas_[0], 0, 0, *deltas_[1:],
                        0, 0, 0, 0))  # fmt: skip
            else:  # the general step's batch: applied as the general step applies it
                sched.update(b_, end_)
                done = dropped_ + (self.drain(end_) if sched.done else 0)
                record(self.row(start_, dt_, sched, b_, deltas_, done))
                pool = None
            if usage is not None:
                usage.add(m.held)
            taken += 1
        self.taken += taken
        return clock, free, k, prev, taken
