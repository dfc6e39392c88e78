"""Async quiet runs: under the async output, steps whose RUNNING pass visits no one or plain decodes
alone, taken back to back in a loop of their own (an exact shortcut behind `SimConfig.shortcuts`).

A lightly loaded engine spends most of its steps with one or a few requests running, each decoding
inside its last block (`sim.engine.shortcuts.AsyncLazy`), nothing waiting. Such a step's schedule is
the lazy totals alone (`Scheduler.lazy_batch`, what `schedule` gives when its RUNNING pass visits no
one), and the output of a batch made so applies nothing: no member samples, caches or finishes, and
the internal fragmentation is the lazy sums' (`AsyncLazy.applied_slots`). A loaded engine spends
most of its steps decoding: its pass visits the few sequences whose block fills or whose request
ends (the rest lazy), each asking for one token, and WAITING's head is blocked on blocks or nothing
waits. Such a step's schedule is `AsyncQuietRuns._decodes`: the pass as `_schedule_running` takes
plain decodes, without its branches for chunks, preemption and a binding budget, then WAITING
offered the rest as `schedule` offers it (`Scheduler.offer_rest`: a blocked head is skipped, and
an admission there is the general step's own).

`AsyncQuietRuns.run` keeps the engine's two-deep batch queue as `Engine._steps` does (schedule step
k, then apply step k - 1's output at its end, arrivals queued first). The output of a batch of lazy
decodes alone that no one joined since (`AsyncLazy.drop` adds a woken sequence to the batch in
flight) gets a row built from what the run knows (the pool's figures read once while only such
batches run: they take, free and cache nothing); any other output is applied as the general step
applies it (`Scheduler.update`, `loop.step_row`), the first a run applies, the general step's
batch, among them.

A step is taken here while, before it: nothing finished is left undrained and the batch in flight
ran; and every running sequence is lazy with none due, the budget holding their tokens, and WAITING
empty (`Shortcuts.lazy_only`), or each sequence the pass visits (the lazy ones due woken first) asks
for one decode token past its prompt, in its last block unshared or in a new one, the new ones at
most the free blocks, and the budget holds them (`_decodes`). With KV events each applied step's
batch of them is handed on where the general step hands it on (`events`: after the output, before
the drain). Off with a fixed step time, defrag, invariant checks, the prefill cadence, a connector
(the async lazy decodes run without one) and a P/D cluster's replica (whose schedule first lets the
others reach its start, `ReplicaFront.ahead`; other clusters' replicas take runs, yielding where the
general step yields); wherever the async output's lazy decodes are off. Plain decodes need one group
with no window (`decode_slot` takes their slot), so a hybrid model's runs (a Mamba one's too, whose
chunking only admissions apply) are steps of lazy decodes alone.

Where the batch in flight is one of lazy decodes alone and the next steps are too (no arrival or
other SimPy event before them, no wake), `_stretch` takes them back to back without a `Batch` each
(not with KV events or op records, whose stamps and batches go step by step): most steps of a
lightly loaded engine.

Measured (docs/benchmarks.md): 1,500 RAGPulse requests, about one running, 0.84x the wall time of
the general step (lazy decodes alone), and 0.94x of that with plain decodes taken here too; the
Azure one-replica run (its WAITING never empty, about 1.75 sequences visited a step), 0.90x.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from operator import sub
from typing import TYPE_CHECKING, Any

from kvsim.kvcache.ops import CHARGED_KINDS
from kvsim.sim.engine.batch import Batch
from kvsim.sim.engine.config import SimConfig
from kvsim.sim.engine.scheduler import Scheduler

if TYPE_CHECKING:
    import simpy

    from kvsim.kvcache.pool_view import PoolView
    from kvsim.sim.engine.cost_model import CostModel
    from kvsim.sim.engine.metrics import GroupUsage
    from kvsim.sim.engine.step_log import StepLog

NO_OPS = dict.fromkeys(CHARGED_KINDS, 0)  # what a cost model is told a step without charged ops did


def _pool(m: PoolView) -> tuple[int, int, int]:
    """The manager's free, cached free and id-space fragmentation blocks: what a lazy row reads of it."""
    return m.num_free_blocks, m.num_cached_free_blocks, m.id_space_fragmentation()


def lazy_row(start: float, dt: float, running: int, waiting: int, swapped: int, lazy: int, context: int,
             pool: tuple[int, int, int], usable: int, frag: int, deltas: tuple[int, ...]) -> tuple:
    """The steps table's row (`STEP_FIELDS` order, as `loop.step_row`) of a batch of `lazy` lazy
    decodes alone whose output applied nothing: `pool`, the pool's (free, cached free, id-space
    fragmentation) blocks; `deltas`, its evict count then its counts of `CHARGED_KINDS`."""
    free = pool[0]
    return (start, dt, running, waiting, swapped, lazy, 0, lazy, context, free, pool[1], usable - free, pool[2],
            frag, deltas[0], 0, 0, *deltas[1:], 0, 0, 0, 0)  # fmt: skip


class AsyncQuietRuns:
    """One async engine's quiet runs: the scheduler, manager and logs they drive, and steps taken."""

    def __init__(self, sched: Scheduler, env: simpy.Environment, cost: CostModel, steps: StepLog,
                 counts: Callable[[], tuple[int, ...]], row: Callable[..., tuple], upto: Callable[[float], Any],
                 drain: Callable[[float], int], usage: GroupUsage | None,
                 events: Callable[[float, int], None] | None = None):
        self.sched, self.env, self.cost, self.steps = sched, env, cost, steps
        self.counts = counts  # the manager's evict count, then its counts of CHARGED_KINDS (`loop._counts`)
        self.row = row  # the general step's row (`loop.step_row`), for the output it applies here
        self.upto = upto  # the front end's arrivals up to a time (`Frontend.upto`, a generator)
        self.drain = drain  # the engine's `_drain_done`
        self.usage = usage  # each group's blocks after each step (vLLM's hybrid groups), or None
        self.events = events  # (end, step): hands on the KV events queued (the engine's `_take_events`), or None
        self.taken = 0  # steps taken so far
        self.decoded = 0  # of those, steps whose RUNNING pass visits plain decodes (`_decodes`)
        # steps of plain decodes: one group with no window, whose decode token takes its slot from
        # `decode_slot` as the RUNNING pass takes it
        m = sched.m
        self.plain = m.num_groups == 1 and m.sliding_window is None

    @classmethod
    def build(cls, cfg: SimConfig, sched: Scheduler, env: simpy.Environment, cost: CostModel, steps: StepLog,
              counts: Callable[[], tuple[int, ...]], row: Callable[..., tuple], upto: Callable[[float], Any],
              drain: Callable[[float], int], usage: GroupUsage | None, *,
              events: Callable[[float, int], None] | None, ahead: bool) -> AsyncQuietRuns | None:
        """The runs for an engine's step loop (`events(end, step)`: its `_take_events`, with KV events),
        or None where they do not apply (module docstring)."""
        if not sched.fast.async_decodes or ahead or sched.prefill.cadence is not None:
            return None
        if cfg.step_time is not None or cfg.defrag_threshold is not None or cfg.debug_invariants:
            return None
        return cls(sched, env, cost, steps, counts, row, upto, drain, usage, events)

    def _decodes(self, start: float) -> Batch | None:
        """`Scheduler.schedule` for the step about to be scheduled, if its RUNNING pass may be taken as
        plain decodes: each sequence it visits (the lazy ones due woken first, as `Shortcuts.begin`
        wakes them) asks for one decode token past its prompt in its last block, unshared, or in a new
        one, the new ones at most the free blocks, and the budget holds them all. Then the pass is
        what `_schedule_running` does for them (none preempts, none is cut to a chunk, the budget
        binds nowhere), and WAITING is offered the rest (`Scheduler.offer_rest`). None where the step
        is anything else: nothing is changed then but the waking, which the general step does first
        anyway."""
        sched = self.sched
        fast, m = sched.fast, sched.m
        k = sched.steps_scheduled + 1
        fast.wake(k)
        lazies, active = fast.lazy, fast.active
        budget = sched.max_tokens - lazies.n
        if budget < len(active):
            return None
        bs, tables, max_len = m.block_size, m.block_tables, sched.max_len
        allocs = known = 0
        visited = []  # in RUNNING order
        for live in active:
            seq = live.seq
            c = seq.num_computed_tokens
            known += seq.num_tokens - c  # (`Shortcuts.begin` visits every lazy one where these pass the budget)
            ph = live.ph
            if ph and c + 2 - ph >= live.limit:
                continue  # its in-flight output reaches max_tokens: the pass skips it
            if seq.num_tokens + ph - c != 1 or c < seq.num_prompt_tokens or live.prefilling \
                    or (max_len is not None and c + 2 > max_len):
                return None
            i = c // bs
            blocks = tables[seq.seq_id]
            if i == len(blocks):
                allocs += 1
            elif i > len(blocks) or (c % bs and blocks[i].ref_cnt > 1):
                return None
            visited.append(live)
        visits = len(visited)
        if not (visits or lazies.n) or allocs > m.num_free_blocks or known > budget:
            return None
        b = Batch(start=start, k=sched.quiet_step())
        if not active:  # every running sequence lazy, none due: the pass's lazy totals alone
            fast.lazy_step(b, k, sched.max_tokens)
        else:
            fast.stamp(k)
            slot, cache, after = m.decode_slot, m.cache_blocks, fast.after
            lives, tokens = b.lives, b.tokens
            context = 0
            for live in visited:
                seq = live.seq
                c = seq.num_computed_tokens
                slot(seq)  # (a new block, or a write to its last one)
                cache(seq, min(c + 1, seq.num_tokens))  # (the async output caches known tokens alone)
                context += c + 1
                lives.append(live)
                tokens.append(1)
                after(live, c, k)  # (lazy after this step, where it may be)
            b.context_tokens = context
            b.decode_tokens = visits
            fast.end(b, k)
        sched.offer_rest(b, budget - visits, start)
        return b

    def _stretch(self, queue: deque[tuple], clock: float, free: float, k: int, prev: tuple[int, ...],
                 pool: tuple | None) -> tuple[float, float, int, tuple[int, ...], int, tuple | None]:
        """`run`'s steps of lazy decodes alone, back to back, each scheduled while the batch in flight
        is one whose output applies nothing, up to the first step an arrival (or another SimPy event)
        or a wake would change (`run` takes that one as it takes any). `run` asks only where every
        running sequence is lazy, none due, WAITING empty (`lazy_only`), with no KV events and no op
        records. Nothing moves then but the clock and the lazy sums' step number, so each step is
        what `run` does for it without a `Batch` each (the one left in flight is made), the
        scheduler's and manager's step state and write count set once at the end (nothing reads them
        between), and the op counts read once: an output that applies nothing changes none. Returns
        the run's state and the steps taken."""
        sched, m = self.sched, self.sched.m
        lazy, running = sched.fast.lazy, sched.running
        b_, start_, end_, dt_, step_, deltas_, dropped_ = queue[0]
        kk = sched.steps_scheduled + 1
        # the first step a lazy sequence is due, and the next SimPy event (an arrival, say)
        due = min(lazy.wakes) if lazy.wakes else kk + 1
        arrival = self.env.peek()
        if b_.lives or b_.prefill_tokens or lazy.n != len(running) or dropped_ or kk >= due \
                or arrival <= (end_ if end_ > clock else clock):
            return clock, free, k, prev, 0, pool  # (`run` takes the step as it takes any)
        n, ctx0, slots0, nl_ = lazy.n, lazy.context_tokens(0), lazy.applied_slots(0), b_.lazy
        nrun, nswap = len(running), len(sched.swapped)
        step_time, record, usage, usable = self.cost.step_time, self.steps.record, self.usage, m.num_usable_blocks
        now = self.counts()
        deltas = tuple(map(sub, now, prev))
        ops = NO_OPS if not any(deltas[1:]) else dict(zip(CHARGED_KINDS, deltas[1:], strict=True))
        zeros = (0,) * len(deltas)
        if pool is None:
            pool = _pool(m)
        ctx_, k_ = b_.context_tokens, b_.k  # the batch in flight's, as its row reads them
        taken = 0
        while kk < due and arrival > (end_ if end_ > clock else clock):
            start = free if free > clock else clock  # step kk: scheduled at once
            ctx = ctx0 + n * kk
            dt = step_time(0, n, ctx, n, ops)
            free = start + dt
            if end_ > clock:
                clock = end_
            # then the output of the batch in flight: nothing applied, its row from the lazy sums
            record(lazy_row(start_, dt_, nrun, 0, nswap, nl_, ctx_, pool, usable, slots0 - n * k_, deltas_))
            if usage is not None:
                usage.add(m.held)
            start_, end_, dt_, step_, deltas_, ctx_, k_, nl_ = start, free, dt, k, deltas, ctx, kk, n
            deltas, ops = zeros, NO_OPS
            k += 1
            kk += 1
            taken += 1
        b = Batch(start=start_, k=k_)  # the last one scheduled, in flight now
        b.lazy = b.decode_tokens = n
        b.context_tokens = ctx_
        queue[0] = (b, start_, end_, dt_, step_, deltas_, 0)
        sched.scheduled_lazily(b)
        m.count_writes(n * taken)  # (each step's lazy decodes: one write each)
        sched.internal_fragmentation = slots0 - n * (k_ - 1)  # (the output applied last: step k_ - 1's)
        sched.step = step_ - 1
        m.set_step(step_ - 1, output=True)
        return clock, free, k, now, taken, pool

    def ready(self, queue: deque[tuple]) -> bool:
        """Whether the step about to be scheduled may start a run: one batch in flight, one that ran,
        nothing finished but not drained."""
        return len(queue) == 1 and queue[0][1] is not None and not self.sched.done

    def run(self, queue: deque[tuple], clock: float, free: float, k: int, prev: tuple[int, ...]):
        """Take steps while each may be taken here (see the module docstring), from the engine's
        state at the top of its loop: its batch queue (one batch in flight), clock, when the device
        is free, batches run, op counts at the last schedule. Returns those after the run and the
        steps taken (a generator: it yields to SimPy where an arrival falls before the clock)."""
        sched, m, env = self.sched, self.sched.m, self.env
        fast, record, step_time, counts = sched.fast, self.steps.record, self.cost.step_time, self.counts
        lazy, lazy_only, decodes = fast.lazy, fast.lazy_only, self._decodes if self.plain else None
        waiting, swapped = sched.waiting, sched.swapped  # (RUNNING is a new list after each retirement)
        max_tokens, usable, usage, events = sched.max_tokens, m.num_usable_blocks, self.usage, self.events
        zeros = (0,) * (len(prev) - 1)
        taken = 0
        pool = None  # (free, cached free, id-space fragmentation): read once a lazy output is applied
        stretches = events is None and not m.records_ops  # (`_stretch`: no per-step events or op stamps)
        while not sched.done:
            if stretches and taken and not waiting and lazy_only(sched.steps_scheduled + 1, max_tokens):
                clock, free, k, prev, n, pool = self._stretch(queue, clock, free, k, prev, pool)
                taken += n
            start = free if free > clock else clock
            step = k
            sched.step = step
            m.set_step(step)
            if not waiting and lazy_only(sched.steps_scheduled + 1, max_tokens):
                b = sched.lazy_batch(start)
            elif decodes is not None and (b := decodes(start)) is not None:
                pool = None  # (its decodes take and cache blocks)
                self.decoded += 1
            else:
                break
            dropped = self.drain(start) if sched.done else 0  # (an admission found a prompt that never fits)
            now = counts()
            deltas = tuple(map(sub, now, prev))
            prev = now
            ops = NO_OPS if deltas[1:] == zeros else dict(zip(CHARGED_KINDS, deltas[1:], strict=True))
            dt = step_time(b.prefill_tokens, b.decode_tokens, b.context_tokens, b.num_seqs, ops, b.chunks)
            free = end = start + dt
            k += 1
            b_, start_, end_, dt_, step_, deltas_, dropped_ = queue.pop()
            queue.appendleft((b, start, end, dt, step, deltas, dropped))
            if end_ > clock:
                clock = end_
            if env.peek() <= clock:  # arrivals while it ran are queued before its output
                yield from self.upto(clock)
            sched.step = step_
            m.set_step(step_, output=True)
            if taken and not b_.lives and not b_.prefill_tokens and lazy.n == len(sched.running) and not dropped_:
                # a batch of lazy decodes alone this run scheduled: its output applies nothing
                # (`AsyncOutput.update`), and no one joined it since (`AsyncLazy.drop`)
                frag = sched.internal_fragmentation = lazy.applied_slots(b_.k)
                if events is not None:  # as the general step does (none queued: a visit would have joined b_)
                    events(end_, step_)
                if pool is None:
                    pool = _pool(m)
                record(lazy_row(start_, dt_, len(sched.running), len(waiting), len(swapped), b_.lazy,
                                b_.context_tokens, pool, usable, frag, deltas_))
            else:  # applied as the general step applies it
                sched.update(b_, end_)
                if events is not None:  # as the general step hands them on: after the output, before the drain
                    events(end_, step_)
                done = dropped_ + (self.drain(end_) if sched.done else 0)
                record(self.row(start_, dt_, sched, b_, deltas_, done))
                pool = None
            if usage is not None:
                usage.add(m.held)
            taken += 1
            if sched.done:  # (the general step drains them first)
                break
        self.taken += taken
        return clock, free, k, prev, taken
