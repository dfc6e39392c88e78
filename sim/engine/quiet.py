"""Quiet runs: steps in which every running sequence decodes one token and nothing else happens,
taken in a tight loop of their own (an exact shortcut behind `SimConfig.shortcuts`).

Most steps of a loaded engine are quiet: no prefill, no admission (WAITING is empty, or its head
is blocked on KV blocks) and no preemption; only context lengths grow, a few sequences cross a
block boundary (a new block, or a full block cached), and some sample their last token.
`QuietRuns.run` takes such steps one after another without the general step: it checks, before
each step, that the step must be quiet (`_visits`), then applies its decodes as
`Shortcuts.decode` and `end` would (`_decode`: the same block-manager calls, in RUNNING order,
so blocks are taken, evicted and cached exactly as in plain stepping; with exact LRU one take
serves the step's new blocks), times it with the same `cost.step_time` call, and logs the same
row. Sequences that sample their last token are freed when the step is done (`Scheduler.finish`,
as `complete` frees them); that changes what the next admission may do, so it is decided again.
The first step that may be anything else goes back to the engine's general step.

A step is quiet when, before it: nothing is swapped; every sequence the step visits (the lazy
ones due now, and those not lazy) is past its prompt with one token to compute, writes no block
shared with a fork, and the new blocks the step takes are free now (nothing frees before the
step is done); and the admission after the decodes must do nothing. That is
decided as `Scheduler._admit_waiting` would begin it, on the state before the step (WAITING
empty, no room in RUNNING, or a blocked head): a blocked head stays blocked through the decodes
(see `BlockedHead.still`: they free nothing) unless they cache the key its lookup stopped at, or,
when the budget can cut its chunk, evict one of its hit blocks (with LRU the blocks taken are the
front of the free queue; with another policy any eviction counts); either ends the run before
the step. Arrivals join WAITING behind its head, so the verdict is kept while the head is the same.
Over vLLM's hybrid groups a visit may let a window's blocks go (at a block's last slot, or anywhere
at a first decode), so under a blocked head a step runs quiet only while the blocks its visits would
take out (`num_skipped_blocks`, at least what they free) stay below what the head still lacks
(`BlockedHead.margin`, counted from the frees since it blocked), none of them may cache a key of the
head's prefix in any group (`caches_watched`), and its new blocks cannot evict a block of its hit.

With op records (one group) a step's recorded decodes go to the manager in one call (`decode_in_place`, the
rows of a `decode_slot` each). Off with op records over hybrid groups, defragmentation, invariant checks, a
fixed step time and the prefill cadence
(the general step handles those), and wherever lazy decodes are off (`Shortcuts.decodes`: sliding window, lookahead,
priority scheduling; the async and offloading schedulers). With the NIXL connector a run stops
before a step whose poll could find a read or a release done (`next_change`, after a finish the
connector holds, or after a yield to SimPy), so beside reads in flight each quiet step's poll would
find nothing, and the holding queue's scan, every held request skipped, changes nothing (its skip is
recorded only for the prefill cadence, which has no quiet runs); a request that reaches the engine
meanwhile is a new head, decided again. With KV events each quiet step hands on the batch its
decodes queued, as the general step does (`events`), and `decode_in_place` takes each new block
with its sequence, so a take's `BlockRemoved`s fall between the cachings as vLLM queues them.
(An earlier attempt at runs beside reads made `kvsim conform
--random 147:148 --pd` differ; with the link's reads moved from event to event and the gate alone
lifted, that case and the `--pd` random cases conform.)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvsim.kvcache.ops import CHARGED_KINDS
from kvsim.kvcache.sequence import Sequence
from kvsim.sim.engine.batch import Live
from kvsim.sim.engine.config import SimConfig
from kvsim.sim.engine.scheduler import Scheduler

if TYPE_CHECKING:
    import simpy

    from kvsim.sim.engine.cost_model import CostModel
    from kvsim.sim.engine.metrics import GroupUsage
    from kvsim.sim.engine.step_log import StepLog

NO_OPS = dict.fromkeys(CHARGED_KINDS, 0)  # what a cost model is told a step without charged ops did

class QuietRuns:
    """One engine's quiet runs: the scheduler, manager and logs they drive, and steps taken so far."""

    def __init__(self, sched: Scheduler, env: simpy.Environment, cost: CostModel, steps: StepLog,
                 drain: Callable[[float], int], usage: GroupUsage | None = None,
                 events: Callable[[float, int], None] | None = None):
        self.sched, self.env, self.cost, self.steps, self.drain = sched, env, cost, steps, drain
        self.usage = usage  # each group's blocks after each step (vLLM's hybrid groups), or None
        self.events = events  # (end, step): hands on the step's KV events (the engine's `_take_events`), or None
        self.fast = sched.fast
        self.m = m = sched.m
        self.bs = m.block_size
        self.tables = m.block_tables
        self.taken = 0  # quiet steps taken so far
        self.allocs = 0  # new blocks the step `_visits` just cleared takes
        self.finishing: list[Live] = []  # the sequences the step `_decode` just took sampled their last token
        self.lru = m.free_order_is_lru  # exact LRU: its free queue's order is all that picks blocks
        # vLLM's hybrid groups: a new block is one a group, and a visit may let a window's blocks go
        self.groups = m.num_groups
        self.blocked = False  # the last verdict rests on a blocked head (which blocks let go may unblock)
        # op records (one group): each quiet step stamps its ops, and a visit records its write as
        # `Shortcuts.decode` does (a lazy run's writes are recorded when it is woken, late)
        self.records = m.records_ops
        self._hits: tuple[object, list, set[int]] = (None, [], set())  # a BlockedHead, its hits and their ids

    @classmethod
    def build(cls, cfg: SimConfig, sched: Scheduler, env: simpy.Environment, cost: CostModel, steps: StepLog,
              drain: Callable[[float], int], usage: GroupUsage | None = None,
              events: Callable[[float, int], None] | None = None) -> QuietRuns | None:
        """Quiet runs for an engine's step loop (`drain(now)`: its `_drain_done`; `events(end, step)`:
        its `_take_events`, with KV events), or None where they do not apply (see the module docstring)."""
        if not sched.fast.decodes or sched.prefill.cadence or getattr(sched.m, "has_mamba", False) \
                or (sched.m.records_ops and sched.m.num_groups > 1):
            return None
        if cfg.step_time is not None or cfg.defrag_threshold is not None or cfg.debug_invariants:
            return None
        return cls(sched, env, cost, steps, drain, usage, events)

    def _admission(self, n: int) -> tuple[bool, int | None, bool]:
        """Whether the admission after this step's decodes (n running) must do nothing; if so
        because the head is blocked, the key whose caching would unblock it (None: none) and
        whether an eviction might."""
        sched = self.sched
        waiting = sched.waiting
        budget = sched.max_tokens - n  # every running sequence takes one token
        self.blocked = False
        if not waiting or budget <= 0:
            return True, None, False
        live = waiting.peek()
        seq = live.seq
        if n + (live.req.n if seq is None else 1) > sched.max_active:
            return True, None, False
        if seq is None:  # its first try makes its sequence: the general step does that
            return False, None, False
        prefill = sched.prefill
        chunk = prefill.chunk_cap(n + len(waiting)) if prefill.long_prefill else 0
        fast = self.fast
        if not fast.head_blocked(live, min(budget, chunk or budget)):
            return False, None, False
        self.blocked = True
        if self.groups > 1:  # the manager watches the whole hit (`_visits`), evicted in any group
            return True, None, True
        m, k = self.m, len(fast.blocked.hits)
        watch = seq.block_hashes[k] if m.enable_caching and k < (seq.num_tokens - 1) // self.bs else None
        return True, watch, budget < seq.num_tokens

    def _visits(self, k: int, watch: int | None, evicts: bool, free: int) -> bool:
        """Wake the lazy sequences due at step k; True if every sequence step k visits decodes
        quietly (taking at most the `free` blocks there are) and leaves the admission as it found
        it (see the module docstring). Waking is what the general step does first anyway."""
        fast, lazy = self.fast, self.fast.lazy
        fast.wake(k)
        active = fast.active
        if self.sched.max_tokens - lazy.n < len(active):
            return False
        m = self.m
        # vLLM's hybrid groups under a blocked head: a visit may let a window's blocks go, and fewer
        # than its margin keep it blocked; a visit may cache a key of its hit in any group
        windows = self.groups > 1 and self.blocked
        let_go = 0
        bs, tables, allocs, per = self.bs, self.tables, 0, self.groups
        for live in active:
            seq = live.seq
            c = seq.num_computed_tokens
            if seq.num_tokens - c != 1 or c < seq.num_prompt_tokens:
                return False
            if windows:
                let_go += m.num_skipped_blocks(seq)
                if (c + 1) % bs == 0 and m.caches_watched(seq, c + 1):
                    return False
            r, i = c % bs, c // bs
            blocks = tables[seq.seq_id]
            if r and r < bs - 1:  # mid-block: in place, unless shared (copy-on-write)
                if blocks[i].ref_cnt != 1:
                    return False
                continue
            # KVCacheManager.decode_slot: a new block, or a write to the last one (and caching it when full)
            if i == len(blocks):
                allocs += per
            elif i > len(blocks) or (r and blocks[i].ref_cnt > 1):
                return False
            if watch is not None and (c + 1) % bs == 0 and self._caches(seq, c + 1, watch):
                return False
        if let_go and let_go >= self.fast.blocked.margin():
            return False
        self.allocs = allocs
        if not allocs:
            return True
        if allocs > free:
            return False
        # (with windows the step's takes may follow its frees: the blocks they put at the front are
        # uncached, those at the back are not reached, so the blocks taken from the queue as it is
        # now are still among its first `allocs`)
        return not (evicts and m.num_cached_free_blocks and self._evicts_hit(allocs))

    def _evicts_hit(self, n: int) -> bool:
        """True if taking `n` free blocks may evict one of the blocked head's hits. With LRU the
        blocks taken are the first n of its free queue (nothing else pops, pushes or touches
        during the decodes); with another policy, any may be."""
        if not self.lru:
            return True
        blocked = self.fast.blocked
        if self._hits[0] is not blocked:  # a new one: often the same head with the same hits again
            same = self._hits[1] == blocked.hits  # (compares blocks by identity: they define no __eq__)
            # (vLLM's hybrid groups: a hit is one list of blocks a group)
            flat = [b for t in blocked.hits for b in t] if self.groups > 1 else blocked.hits
            self._hits = (blocked, blocked.hits, self._hits[2] if same else {id(b) for b in flat})
        hits = self._hits[2]
        return any(id(b) in hits for b in self.m.next_free_blocks(n))

    def _caches(self, seq: Sequence, num_tokens: int, key: int) -> bool:
        """True if caching `seq`'s full blocks within `num_tokens` would register `key` (a key of
        the blocked head, another sequence: so only blocks within `seq`'s known tokens can)."""
        bs = self.bs
        n_full = min(num_tokens, seq.num_known_tokens) // bs
        lo = self.m.num_cached_blocks_of(seq.seq_id)
        return lo < n_full and key in seq.hashes_upto(n_full * bs, bs)[lo:n_full]

    def _decode(self, k: int) -> tuple[int, int, int]:
        """Step k's decodes, after `_visits` said yes: what `Shortcuts.decode` does for each
        visited sequence in RUNNING order, then `Shortcuts.end`. Returns the step's decode
        tokens, context tokens and internal fragmentation (every running sequence decodes)."""
        fast, lazy, m, bs = self.fast, self.fast.lazy, self.m, self.bs
        window = lazy.window
        # KVCacheManager.decode_slot for those whose token starts a block or fills one (with op records,
        # and those whose write is recorded now: `_recorded`), in RUNNING order (nothing below touches
        # the manager): with exact LRU, one take for the step's new blocks
        counted = 0  # the writes recorded (and counted) now
        if self.groups > 1:  # every visit: a window lets its blocks go at any slot (`Shortcuts.decode`)
            m.decode_in_place([live.seq for live in fast.active])
        elif self.records:
            recorded = self._recorded()
            counted = len(recorded)
            m.decode_in_place(recorded, self.allocs if self.lru else 0)
        else:
            edge = [live.seq for live in fast.active if (live.seq.num_computed_tokens + 1) % bs < 2]
            if edge:
                m.decode_in_place(edge, self.allocs if self.lru else 0)
        stay = []  # visited and decoded in place (not lazy): next step visits them again
        finishing = self.finishing = []  # of the visited, those sampling their last token
        context = frag = 0
        for live in fast.active:
            seq = live.seq
            c = seq.num_computed_tokens
            r = c % bs
            last = window(seq, c)  # (the lazy rule, as `_recorded` reads it)
            if live.target - c - 3 < last:
                last = live.target - c - 3
            if last > 0:
                lazy.add(live, k, last)
                continue
            seq.num_computed_tokens = c + 1
            seq.num_tokens += 1
            context += c + 1
            if c + 2 >= live.target:
                finishing.append(live)
                continue
            stay.append(live)
            if r < bs - 1:
                frag += bs - r - 2
        fast.active = stay
        nl = lazy.n
        decodes = len(stay) + len(finishing) + nl
        m.count_writes(decodes - counted)  # one write a decode
        return decodes, context + lazy.context_tokens(k), frag + lazy.empty_slots(k)

    def _recorded(self) -> list[Sequence]:
        """The visited sequences whose decode is recorded in this step, in RUNNING order: those at
        a block's first or last slot (a new block, or one cached), and those not going lazy (the
        rule of `_decode`'s loop); a lazy one's writes are recorded when it wakes, late
        (`Shortcuts.decode`)."""
        window, bs = self.fast.lazy.window, self.bs
        out = []
        for live in self.fast.active:
            seq = live.seq
            c = seq.num_computed_tokens
            if (c + 1) % bs < 2 or min(window(seq, c), live.target - c - 3) <= 0:
                out.append(seq)
        return out

    def run(self, clock: float, k: int, prev: tuple[int, ...]):
        """Take the quiet steps from engine step k at `clock` on (a SimPy generator); returns the
        engine's (clock, k, prev) after them, for the general step that follows."""
        sched, m = self.sched, self.m
        env, step_time, record, drain = self.env, self.cost.step_time, self.steps.record, self.drain
        running, waiting = sched.running, sched.waiting
        conn = sched.connector  # the NIXL connector's: no step starts once a transfer may be done
        until = conn.next_change(clock) if conn is not None else math.inf
        usable = m.num_usable_blocks
        count = m.op_counts.get
        if sched.swapped or sched.done:
            return clock, k, prev
        n_run = len(running)
        head = waiting.peek() if waiting else None  # the head the admission verdict is for
        n_wait = len(waiting)
        ok, watch, evicts = self._admission(n_run)
        # NOTE: only a step's new blocks and its finishes change the free count and the id span
        # (its decodes free nothing), and only a yield to SimPy lets an arrival change WAITING
        free = m.num_free_blocks
        span = m.id_space_fragmentation()
        fast = self.fast
        lazy = fast.lazy
        while ok:
            if clock >= until:  # this step's poll could see a read or a release done: the general step
                break
            kk = sched.steps_scheduled + 1
            if self.records:  # the step's ops stamped with its number, as the general step stamps them
                m.set_step(k)
                fast.stamp(kk)
            if not fast.active and kk not in lazy.wakes:
                # NOTE: a step that visits no one: the lazy sums are its totals, and the budget
                # holds them all (lazy decodes need max_num_seqs <= the step budget)
                sched.quiet_step()
                self.allocs, self.finishing, tokens = 0, [], lazy.n
                m.count_writes(tokens)
                context, frag = lazy.context_tokens(kk), lazy.empty_slots(kk)
            else:
                if not self._visits(kk, watch, evicts, free):
                    break
                sched.quiet_step()
                tokens, context, frag = self._decode(kk)
            if self.groups > 1:  # (blocks let go behind windows too)
                free = m.num_free_blocks
                span = m.id_space_fragmentation()
            elif self.allocs:
                free -= self.allocs
                span = m.id_space_fragmentation()
            t0 = clock
            dt = step_time(0, tokens, context, n_run, NO_OPS)
            clock = t0 + dt
            arrived = env.peek() <= clock
            if arrived:
                yield env.timeout(clock - env.now)
                n_wait = len(waiting)
                if conn is not None:  # other replicas' reads, or a finish it holds, may move it
                    until = conn.next_change(clock)
            finishing = self.finishing
            if finishing:  # as `SyncOutput.update`: their blocks free once the step is done
                sched.step = k
                sched.finish(finishing, clock)
                free = m.num_free_blocks
                span = m.id_space_fragmentation()
            sched.internal_fragmentation = frag
            if self.events is not None:  # as the general step hands them on: after the output, before the drain
                self.events(clock, k)
            done = drain(clock) if sched.done else 0
            evicted = count("evict", 0)
            record((
                t0, dt, n_run - len(finishing), n_wait, 0, n_run, 0, tokens, context,
                free, m.num_cached_free_blocks, usable - free, span, frag,
                evicted - prev[0], 0, 0, 0, 0, 0, 0, 0, 0, 0, done,
            ))  # fmt: skip
            if self.usage is not None:
                self.usage.add(m.held)
            prev = (evicted, *prev[1:])
            k += 1
            self.taken += 1
            # NOTE: a quiet step's decodes free nothing (over hybrid groups: fewer blocks than a
            # blocked head lacks, checked step by step in `_visits`), cache no key the blocked head waits on and
            # evict none of its hits, so without a finish the verdict holds while the head is the
            # same (arrivals join behind)
            if finishing:  # freed blocks and a smaller batch: the admission is decided again
                n_run -= len(finishing)
                if not n_run:
                    break
                if conn is not None:  # other replicas' reads, or a finish it holds, may move it
                    until = conn.next_change(clock)
                head = waiting.peek() if waiting else None
                ok, watch, evicts = self._admission(n_run)
            elif arrived and (waiting.peek() if waiting else None) is not head:
                head = waiting.peek() if waiting else None
                ok, watch, evicts = self._admission(n_run)
        return clock, k, prev
