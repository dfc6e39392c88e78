"""One engine step's scheduling decision, as vLLM 0.33's `Scheduler.schedule`; no simulated clock.

`schedule(now)` builds a batch under a token budget (`max_num_scheduled_tokens`, else
`max_num_batched_tokens`) and `max_num_seqs` (vllm/v1/core/sched/scheduler.py): RUNNING sequences first, each its decode token or next prefill
chunk (capped by `long_prefill_token_threshold`), preempting the newest running sequence when blocks
run out (recompute: free and requeue at the front of WAITING; swap, a v0/v2 option: move its blocks
to CPU). A step that preempted admits nothing. Otherwise swapped sequences come back while they can
be swapped in, then WAITING requests in FCFS (or priority) order, with a prefix-cache lookup, until
RUNNING holds `max_num_active_seqs` (vLLM 0.31+; default `max_num_seqs`) or the first one that cannot
be allocated: its whole known context must fit (`scheduler_reserve_full_isl`, on by default; off, its
chunk), and while any request runs the watermark stays free. `complete(batch, now)` applies the step: computed
tokens advance, a sequence whose known tokens are all computed samples one, and finished sequences are
freed. A request with n > 1 arrived as n requests (vLLM 0.33's fan-out), or, v0-style, forks its samples
after its prefill (both in `sim.engine.arrivals`).

For speed, a step visits only the sequences that need the block manager: mid-block decodes are
counted, not visited, and a blocked head of WAITING is not retried while the retry must fail. Both
are exact shortcuts, in `sim.engine.shortcuts` behind one switch (`SimConfig.shortcuts`).
"""

from __future__ import annotations

import heapq

from kvcache.admission import AllocStatus
from kvcache.manager import KVCacheManager, cdiv
from kvcache.sequence import Sequence
from sim.engine.arrivals import Arrivals
from sim.engine.batch import Batch, Live
from sim.engine.config import SimConfig
from sim.engine.metrics import FINISHED, REASON_CODE, REJECTED, TRUNCATED, RequestLog
from sim.engine.prefill import PrefillRules
from sim.engine.shortcuts import Shortcuts
from sim.engine.wait_queue import WaitQueue
from workloads.request import Request

__all__ = ["Batch", "Live", "Scheduler", "WaitQueue"]  # Batch, Live, WaitQueue: re-exported


class Scheduler(Arrivals, PrefillRules):
    """The WAITING / RUNNING / SWAPPED queues over one KV-cache manager (arrivals: `Arrivals`)."""

    has_shortcuts = True  # takes sim.engine.shortcuts where SimConfig.shortcuts allows
    live_type: type[Live] = Live  # what `add` makes for a request (sim.engine.async_scheduler keeps more)

    def __init__(self, cfg: SimConfig, manager: KVCacheManager, log: RequestLog):
        self.m = manager
        self.log = log
        self.max_seqs = cfg.batch_limits()[1]
        self.max_tokens = cfg.step_tokens()  # a step's token budget
        self.chunked = cfg.enable_chunked_prefill
        self.swap = cfg.preemption == "swap"
        self.priority = cfg.scheduling == "priority"
        self.fork = cfg.parallel_sampling == "fork"  # else n > 1 fans out (sim.engine.arrivals)
        self.lookahead = cfg.num_lookahead_tokens
        self.max_len = cfg.max_model_len
        self._init_prefill(cfg, manager)
        self.max_active = cfg.max_num_active_seqs or self.max_seqs  # admissions into RUNNING stop here
        self.whole_fit = cfg.scheduler_reserve_full_isl  # a WAITING request's whole known context must fit
        self.fast = Shortcuts(manager, cfg.shortcuts and self.has_shortcuts, self.lookahead, self.priority,
                              whole_fit=self.whole_fit, decodes_fit=self.max_seqs <= self.max_tokens)
        self.waiting = WaitQueue(self.priority)
        self.running: list[Live] = []
        self._joined = 0  # lives that joined RUNNING so far (their `order`)
        self._k = 0  # steps scheduled so far
        self.step = 0  # the engine's number for the step being scheduled (logged per request)
        self.swapped: list[tuple[int, int, Live]] = []  # heap by arrival: the oldest resumes first
        self.done: list[Request] = []  # requests finished or dropped since the caller last drained it
        self._open: dict[int, int] = {}  # row -> samples not yet done, of a request with n > 1
        self._uid = 0
        self.internal_fragmentation = 0  # allocated slots not holding a token, after `complete`

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.swapped)

    # ------------------------------------------------------------- schedule
    def schedule(self, now: float) -> Batch:
        """Choose this step's batch and allocate its slots (see the module docstring)."""
        self._k += 1
        b = Batch()
        self._chunk = self.chunk_cap(self._eligible()) if self.long_prefill else 0
        cadence = self.cadence is not None
        if cadence:
            self._hold()
        budget = self._schedule_running(b, now)
        if not (b.preempted_recompute or b.preempted_swap):  # vLLM: no admissions after a preemption
            if self.swapped:
                budget = self._resume_swapped(b, budget, now)
            if self._has_waiting() and not self.swapped:
                self._admit_waiting(b, budget, now)
            if cadence:
                self._released()
        if cadence:
            self._end_prefill(b)
        return b

    def _has_waiting(self) -> bool:
        return bool(self.waiting)

    def idle_until(self, now: float) -> float | None:  # noqa: ARG002
        return None  # a step at `now` scheduled nothing: no progress is possible (see OffloadScheduler)

    @staticmethod
    def _add(b: Batch, live: Live, n: int, sign: int = 1) -> None:
        """Put `live`'s `n` tokens in the batch (sign -1: take them out) and count them:
        a decode is one token past the prompt, anything else is prefill."""
        seq = live.seq
        c = seq.num_computed_tokens
        b.context_tokens += sign * (c + n)
        if n == 1 and c >= seq.num_prompt_tokens:
            b.decode_tokens += sign
        else:
            b.prefill_tokens += sign * n
        if sign > 0:
            b.lives.append(live)
            b.tokens.append(n)
        else:
            k = b.lives.index(live)
            del b.lives[k], b.tokens[k]

    def _schedule_running(self, b: Batch, now: float) -> int:
        k, fast = self._k, self.fast
        budget = fast.begin(k, self.max_tokens, self.running)
        active, decode = fast.active, fast.decodes and fast.decode
        alloc, la = self.m.allocate_slots, self.lookahead
        chunk, hold = self._chunk, self.prefill_held
        i, end = 0, len(active)
        while i < end and budget > 0:
            live = active[i]
            i += 1
            if live.order < 0 or (hold and live.prefilling):  # preempted earlier in this step, or held back
                continue
            seq = live.seq
            c = seq.num_computed_tokens
            n = seq.num_tokens - c
            if n == 1 and decode and c >= seq.num_prompt_tokens and decode(b, live, c, k):
                budget -= 1
                if live.prefilling:  # a resumed sequence's last known token: the end of its prefill
                    self._prefilled, live.prefilling = True, False
                continue
            if 0 < chunk < n:
                n = chunk
            if n > budget:
                n = budget
            if alloc(seq, n, 0, None, la) is None:
                was = fast.lazy.n
                if not self._make_room(live, n, b, now):
                    if self.priority and live.seq.seq_id not in self.m.req_blocks:
                        # vLLM: it preempted itself; those after it may still fit
                        budget = self.max_tokens - sum(b.tokens)
                        continue
                    break
                budget += was - fast.lazy.n  # lazy victims give their token back
                if self.priority:  # victims may have been ahead of it, and scheduled
                    budget = self.max_tokens - sum(b.tokens)
            self._add(b, live, n)
            budget -= n
            if live.prefilling:
                self._prefilled = True
        fast.end(b, k)
        return budget

    def materialize(self, k: int | None = None) -> None:
        """End all lazy decoding: every running `seq` is exact at the start of step `k` (default: the next)."""
        self.fast.materialize(self.running, self._k + 1 if k is None else k)

    def _make_room(self, live: Live, n: int, b: Batch, now: float) -> bool:
        """Preempt until `live`'s `n` tokens fit: True, or False if `live` itself was
        preempted (or dropped, when it is alone and still does not fit)."""
        running = self.running
        while True:
            victim = max(running, key=_priority_key) if self.priority else running[-1]
            if victim is live and len(running) == 1 and not b.num_seqs:
                running.pop()  # alone and still out of blocks: it can never fit
                self._retire_never_fits(live, now)
                return False
            if victim is running[-1]:
                running.pop()
            else:
                running.remove(victim)
            self.fast.preempted(victim, self._k)
            if self.priority and victim in b.lives:  # scheduled earlier this step: undo that
                self._add(b, victim, b.tokens[b.lives.index(victim)], -1)
            self._preempt(victim, b)
            if victim is live:
                return False
            if self.m.allocate_slots(live.seq, n, 0, None, self.lookahead) is not None:
                return True

    def _preempt(self, live: Live, b: Batch) -> None:
        seq = live.seq
        live.order = -1
        self.log.preemptions[live.row] += 1
        if self.swap and self.m.can_swap_out([seq]):
            self.m.swap_out([seq])
            heapq.heappush(self.swapped, (live.row, live.seq.uid, live))
            b.preempted_swap += 1
        else:
            self.m.free(seq)
            seq.num_computed_tokens = 0
            self.waiting.push(live, front=True)
            b.preempted_recompute += 1

    def _resume_swapped(self, b: Batch, budget: int, now: float) -> int:
        m, running = self.m, self.running
        while self.swapped and budget > 0 and len(running) < self.max_active:
            live = self.swapped[0][-1]
            seq = live.seq
            alone = not running and not b.lives
            status = m.can_swap_in([seq], self.lookahead)
            if status is AllocStatus.NEVER and alone:
                heapq.heappop(self.swapped)
                self._drop_swapped(live, now)
                continue
            if not (status is AllocStatus.OK or (alone and status is AllocStatus.LATER)):
                break
            heapq.heappop(self.swapped)
            m.swap_in([seq])
            self._join(live)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if m.allocate_slots(seq, n, 0, None, self.lookahead) is not None:
                self._add(b, live, n)
                budget -= n
        return budget

    def _drop_swapped(self, live: Live, now: float) -> None:
        self.m.drop_swapped(live.seq)
        self._retire(live, TRUNCATED, "context_exceeds_cache", now)

    def _admit_waiting(self, b: Batch, budget: int, now: float) -> None:
        m, running, waiting = self.m, self.running, self.waiting
        while waiting and budget > 0:
            live = waiting.peek()
            width = live.req.n if live.seq is None else 1
            if len(running) + width > self.max_active:
                break
            seq = live.seq if live.seq is not None else self._materialise(live)
            # vLLM allocate_slots(has_scheduled_reqs=bool(self.running)): the watermark
            # applies while anything runs; then blocks may also free up later
            held = bool(running)
            if held and self.fast.head_blocked(live, min(budget, self._chunk or budget)):
                break
            blocks, hit = m.get_computed_blocks(seq)
            if self.prefill_held and hit < seq.num_tokens - 1:  # the cadence holds prompts back
                break
            n = self._admission_tokens(seq, hit, budget, held)
            if not n:
                break
            if m.allocate_slots(seq, n, hit, blocks, self.lookahead, watermark=held,
                                full_sequence_must_fit=self.whole_fit) is None:
                if held:  # FCFS head of line: wait for blocks to free
                    self.fast.block_head(live, blocks, hit, n)
                    break
                waiting.pop()  # nothing else holds blocks: it can never fit
                self._retire_never_fits(live, now)
                continue
            waiting.pop()
            self._admit(b, live, hit, n, now)
            budget -= n

    def _admission_tokens(self, seq: Sequence, hit: int, budget: int, held: bool) -> int:
        """Tokens a waiting `seq` with `hit` computed takes this step (its rest, capped by the chunk and
        the budget); 0: without chunked prefill its prompt must fit one step while others run."""
        n = self._chunk if 0 < self._chunk < seq.num_tokens - hit else seq.num_tokens - hit
        if n > budget:
            return 0 if not self.chunked and held else budget
        return n

    def _retire_never_fits(self, live: Live, now: float) -> None:
        """A request that cannot fit even with nothing else holding blocks: truncated once it has output."""
        dropped = (TRUNCATED, "context_exceeds_cache") if live.seq.num_output_tokens else (REJECTED, "prompt_exceeds_cache")
        self._retire(live, *dropped, now)

    def _admit(self, b: Batch, live: Live, hit: int, n: int, now: float) -> None:
        """Run a waiting request whose `n` tokens after `hit` cached ones got slots; log a first admission."""
        seq = live.seq
        seq.num_computed_tokens = hit
        if self.cadence is not None:
            self._admitted_prefill(live, hit)
        self._join(live)
        self._add(b, live, n)
        log, row = self.log, live.row
        if log.first_scheduled[row] != log.first_scheduled[row]:  # NaN: the request's first admission
            log.first_scheduled[row] = now
            log.first_scheduled_step[row] = self.step
            b.admitted += 1
        if not live.admitted:  # each fanned-out sample's prompt is scheduled, and counted, on its own
            live.admitted = True
            log.hit_tokens[row] += hit
            b.admitted_prompt_tokens += seq.num_prompt_tokens
            b.admitted_hit_tokens += hit

    def _materialise(self, live: Live) -> Sequence:
        if live.keys is None and self.m.enable_caching:  # with the prompts next in line, at once
            self.waiting.hash_ahead(live, self.m.block_size)
        r = live.req
        live.seq = Sequence(r.id, r.prompt, uid=self._uid, output=r.output, keys=live.keys)
        self._uid += 1
        return live.seq

    # ------------------------------------------------------------- complete
    def complete(self, b: Batch, now: float) -> None:
        """Apply a step that ended at `now`: advance tokens, sample, fork, free the finished;
        then set `internal_fragmentation` over the running sequences."""
        log, la, bs = self.log, self.lookahead, self.m.block_size
        finished = list(b.finishing)
        frag, alive = b.frag, len(b.decodes) - len(finished) + b.lazy
        track = self.cadence is not None
        for live, n in zip(b.lives, b.tokens, strict=True):
            seq = live.seq
            c = seq.num_computed_tokens + n
            seq.num_computed_tokens = c
            t = seq.num_tokens
            if track:
                live.prefilling = c < t
            seqs = 1
            if c == t:  # all known tokens computed: sample one
                seq.append_tokens(1)
                t += 1
                row = live.row
                if c == seq.num_prompt_tokens and log.first_token[row] != log.first_token[row]:  # NaN: the first
                    log.first_token[row] = now
                    log.first_token_step[row] = self.step
                    if live.req.n > 1 and t < live.target:
                        seqs = self._fork(live)
                if t >= live.target:
                    finished.append(live)
                    continue
            # NOTE: a running sequence holds exactly cdiv(computed + lookahead) blocks
            f = -(-(c + la) // bs) * bs - t
            if f > 0:
                frag += seqs * f
            alive += seqs
        if finished:
            if b.finishing and len(finished) > len(b.finishing):  # free in batch (= running) order
                pos = {id(x): k for k, x in enumerate(self.running)}
                finished.sort(key=lambda x: pos[id(x)])
            self.finish(finished, now)
        if alive != len(self.running):  # some running sequences were not scheduled
            self.materialize()
            frag = sum(self._fragmentation(x.seq) for x in self.running)
        self.internal_fragmentation = frag

    def finish(self, lives: list[Live], now: float) -> None:
        """`lives` (in RUNNING order) sampled their last tokens in the step that ended at `now`."""
        for live in lives:
            self._retire(live, FINISHED, "", now)
        self.running = [x for x in self.running if x.order >= 0]
        self.fast.active = [x for x in self.fast.active if x.order >= 0]

    def _fragmentation(self, seq: Sequence) -> int:
        """Allocated slots of a running sequence not holding a token (see the NOTE in complete)."""
        return max(0, cdiv(seq.num_computed_tokens + self.lookahead, self.m.block_size) * self.m.block_size
                   - seq.num_tokens)

    def _join(self, live: Live) -> None:
        """`live` joins RUNNING (at the back)."""
        live.order = self._joined
        self._joined += 1
        self.running.append(live)
        self.fast.active.append(live)

    def _retire(self, live: Live, status: int, reason: str, now: float) -> None:
        """A sequence is done (finished or dropped): free its blocks; when it is the
        request's last sample, close the request."""
        seq, row, log = live.seq, live.row, self.log
        live.order = -1
        if self.cadence is not None:
            self.cadence.deferred.discard(live)
        if seq is not None:
            if seq.seq_id in self.m.req_blocks:
                self.fast.free(seq)
            log.output_tokens[row] += (1 if row in self._open else live.req.n) * seq.num_output_tokens
        if status > log.status[row]:
            log.status[row] = status
            log.reason[row] = REASON_CODE[reason]
        left = self._open.get(row)
        if left is not None:
            if left > 1:
                self._open[row] = left - 1
                return
            del self._open[row]
        log.finish[row] = now
        log.finish_step[row] = self.step
        self.done.append(live.parent or live.req)


def _priority_key(live: Live) -> tuple[int, float]:
    """The preemption victim is the running request with the largest key, the first such in
    RUNNING order (vLLM: `max(self.running, key=lambda r: (r.priority, r.arrival_time))`)."""
    return (live.req.priority, live.req.arrival)
