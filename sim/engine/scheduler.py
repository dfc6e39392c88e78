"""One engine step's scheduling decision, as vLLM 0.33's `Scheduler.schedule`; no simulated clock.

`schedule(now)` builds a batch under a token budget (`max_num_batched_tokens`)
and `max_num_seqs` (vllm/v1/core/sched/scheduler.py): RUNNING sequences
first, each its decode token or next prefill chunk (capped by
`long_prefill_token_threshold`), preempting the newest running sequence when
blocks run out (recompute: free and requeue at the front of WAITING; swap, a
v0/v2 option: move its blocks to CPU). A step that preempted admits nothing.
Otherwise swapped sequences come back while they can be swapped in, then
WAITING requests in FCFS (or priority) order, with a prefix-cache lookup,
until the first one that cannot be allocated: its whole known context must
fit (`scheduler_reserve_full_isl`), and while any request runs the watermark
stays free. `complete(batch, now)` applies the step:
computed tokens advance, a sequence whose known tokens are all computed samples
one, a request with n > 1 forks its samples after its prefill, and finished
sequences are freed.

For speed, a step visits only the sequences that need the block manager:
mid-block decodes are counted, not visited (`sim.engine.lazy_decodes`), and a blocked
head of WAITING is not retried while the retry must fail (`BlockedHead`). Both
are exact and switchable (`Scheduler.fast_decode`, `skip_blocked_head`); tests
compare tables with them on and off.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field

from kvcache.admission import AllocStatus
from kvcache.manager import KVCacheManager, cdiv
from kvcache.sequence import Sequence
from sim.engine.config import SimConfig
from sim.engine.lazy_decodes import LazyDecodes
from sim.engine.metrics import FINISHED, REASON_CODE, REJECTED, TRUNCATED, RequestLog
from workloads.request import Request


class Live:
    """One sequence in flight: the request it answers, its KV sequence, and its final length."""

    __slots__ = ("req", "row", "seq", "target", "order", "since", "wake")

    def __init__(self, req: Request, row: int, max_len: int | None = None):
        self.req = req
        self.row = row  # the request's row in the RequestLog (arrival order; shared by its samples)
        self.seq: Sequence | None = None  # made (prompt materialised) at first admission
        self.target = req.prompt_len + max(req.output_len, 1)  # tokens when done
        if max_len is not None and self.target > max_len:
            self.target = max_len  # vLLM stops the sequence at max_model_len
        self.order = -1  # sort key of its place in RUNNING (when it joined); -1: not running
        self.since = -1  # decoding lazily since this step (see sim.engine.lazy_decodes); -1: not
        self.wake = 0  # the step at which lazy decoding ends


@dataclass(slots=True)
class Batch:
    """What one step computes: sequences with their new-token counts, and the step's totals."""

    lives: list[Live] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    decodes: list[Live] = field(default_factory=list)  # in-place decodes, applied when scheduled
    finishing: list[Live] = field(default_factory=list)  # of those, the ones that sampled their last token
    frag: int = 0  # internal fragmentation of the other in-place decodes
    prefill_tokens: int = 0
    decode_tokens: int = 0
    context_tokens: int = 0  # sum of scheduled sequences' lengths after the step
    preempted_recompute: int = 0
    preempted_swap: int = 0
    admitted: int = 0  # requests admitted for the first time
    admitted_prompt_tokens: int = 0
    admitted_hit_tokens: int = 0

    lazy: int = 0  # lazy decodes (see sim.engine.lazy_decodes)

    @property
    def num_seqs(self) -> int:
        return len(self.lives) + len(self.decodes) + self.lazy


class WaitQueue:
    """WAITING requests: FCFS (a deque) or by (priority, arrival, id) (a heap), the order of
    vllm/v1/request.py `Request.__lt__`."""

    def __init__(self, priority: bool):
        self.priority = priority
        self._q: deque[Live] | list[tuple] = [] if priority else deque()
        self._tie = itertools.count()  # forked samples share a row: keep heap keys unique

    def __len__(self) -> int:
        return len(self._q)

    def push(self, live: Live, front: bool = False) -> None:
        """Queue at the back (new) or the front (recompute-preempted); priority mode ignores `front`."""
        if self.priority:
            r = live.req
            heapq.heappush(self._q, (r.priority, r.arrival, r.id, next(self._tie), live))
        elif front:
            self._q.appendleft(live)
        else:
            self._q.append(live)

    def peek(self) -> Live:
        return self._q[0][-1] if self.priority else self._q[0]

    def pop(self) -> Live:
        return heapq.heappop(self._q)[-1] if self.priority else self._q.popleft()

    def remove(self, live: Live) -> None:
        """Take `live` out wherever it is (vLLM's `RequestQueue.remove_request`)."""
        if self.priority:
            self._q = [e for e in self._q if e[-1] is not live]
            heapq.heapify(self._q)
        else:
            self._q.remove(live)


class BlockedHead:
    """The head of WAITING failed to allocate; tells cheaply, and exactly, when a retry must fail too.

    NOTE: with F free blocks, H the hit blocks and n the new slots, allocation
    fails iff deficit = cdiv(hit + n) - |H| + |H free| (+ watermark) - F > 0.
    While H keeps its blocks (none evicted, no new entry at its miss point),
    the deficit shrinks only by freed blocks (at most 1 each), a smaller budget
    or a dropped watermark; allocations elsewhere and touches never shrink it.
    Evictions matter only when the budget can cut the retry short: otherwise
    cdiv(hit + n) is the whole sequence whatever the hit, and a hit block turns
    from free to used (shrinking the deficit by 1) only as some allocation or
    touch takes a free block (growing it by 1).
    """

    __slots__ = ("m", "live", "hits", "deficit", "frees", "evictions", "n", "watermark")

    def __init__(self, m: KVCacheManager, live: Live, blocks: list, hit: int, n: int, lookahead: int,
                 watermark: bool):
        # the admission gate asks for the whole known context (see KVCacheManager.allocate_slots)
        need = m.num_blocks_to_allocate(live.seq, max(hit + n + lookahead, live.seq.num_tokens), blocks)
        self.m, self.live, self.hits, self.n, self.watermark = m, live, blocks, n, watermark
        self.deficit = need + (m.watermark_blocks if watermark else 0) - m.pool.num_free_blocks
        self.frees, self.evictions = m.ops.counts["free"], m.ops.counts["evict"]

    def still(self, live: Live, budget: int, watermark: bool) -> bool:
        """True if allocating `live` now would certainly fail as it did."""
        # NOTE: the retry would ask for min(tokens left, budget) new tokens; with the
        # same hit that is n again unless the budget fell below it
        if live is not self.live or budget < self.n or watermark < self.watermark:
            return False
        m, seq, k = self.m, live.seq, len(self.hits)
        counts = m.ops.counts
        if self.deficit - (counts["free"] - self.frees) <= 0:
            return False
        if m.enable_caching and k < (seq.num_tokens - 1) // m.block_size and seq.block_hashes[k] in m.pool.cached:
            return False  # the hit may have grown
        if counts["evict"] != self.evictions and budget < seq.num_tokens \
                and [b.block_hash for b in self.hits] != seq.block_hashes[:k]:
            return False  # a hit block was evicted, and a shorter hit may mean a smaller chunk
        return True


class Scheduler:
    """The WAITING / RUNNING / SWAPPED queues over one KV-cache manager."""

    # Exact shortcuts, switchable so tests can check they change nothing:
    fast_decode = True  # count a mid-block decode's write without calling allocate_slots; go lazy
    skip_blocked_head = True  # use BlockedHead to skip head-of-line retries that must fail
    live_type: type[Live] = Live  # what `add` makes for a request (sim.engine.async_scheduler keeps more)

    def __init__(self, cfg: SimConfig, manager: KVCacheManager, log: RequestLog):
        self.m = manager
        self.log = log
        self.max_tokens, self.max_seqs = cfg.batch_limits()
        self.chunked = cfg.enable_chunked_prefill
        self.swap = cfg.preemption == "swap"
        self.priority = cfg.scheduling == "priority"
        self.lookahead = cfg.num_lookahead_tokens
        self.max_len = cfg.max_model_len
        self.long_prefill = cfg.long_prefill_token_threshold
        self.long_prefill_sole_request = manager.profile.long_prefill_sole_request
        self._chunk = self.long_prefill  # this step's cap on a request's chunk (0: none), see schedule
        # In-place decode shortcut (see _schedule_running); off where allocate_slots does more.
        self._fast_decode = self.fast_decode and not (
            manager.sliding_window or self.lookahead or manager.ops.enabled or self.priority
        )
        self.waiting = WaitQueue(self.priority)
        self.running: list[Live] = []
        self.active: list[Live] = []  # the running lives not decoding lazily
        self._joined = 0  # lives that joined RUNNING so far (their `order`)
        self._k = 0  # steps scheduled so far
        self.step = 0  # the engine's number for the step being scheduled (logged per request)
        self.lazy = LazyDecodes(manager.block_size)  # running lives decoding mid-block, not visited
        self.swapped: list[tuple[int, int, Live]] = []  # heap by arrival: the oldest resumes first
        self.done: list[Request] = []  # requests finished or dropped since the caller last drained it
        self._blocked: BlockedHead | None = None
        self._open: dict[int, int] = {}  # row -> samples not yet done, for forked requests
        self._uid = 0
        self.internal_fragmentation = 0  # allocated slots not holding a token, after `complete`

    # ------------------------------------------------------------- arrivals
    def add(self, req: Request, now: float) -> None:
        """A request arrives: queue it, or drop it at once if it can never run."""
        row = self.log.add(req.id, now, req.prompt_len, req.output_len, req.n, req.priority)
        reason = self._never_fits(req)
        if reason:
            self.log.status[row] = REJECTED
            self.log.reason[row] = REASON_CODE[reason]
            self.log.finish[row] = now
            self.done.append(req)
            return
        self.waiting.push(self.live_type(req, row, self.max_len))

    def _never_fits(self, req: Request) -> str:
        if self.max_len is not None and req.prompt_len >= self.max_len:
            return "prompt_exceeds_max_model_len"
        if req.n > self.max_seqs:
            return "n_exceeds_max_num_seqs"
        if not self.chunked and req.prompt_len > self.max_tokens:
            return "prompt_exceeds_batch"
        if self.m.sliding_window is None and cdiv(req.prompt_len, self.m.block_size) > self.m.pool.num_usable_blocks:
            return "prompt_exceeds_cache"
        return ""

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.swapped)

    # ------------------------------------------------------------- schedule
    def schedule(self, now: float) -> Batch:
        """Choose this step's batch and allocate its slots (see the module docstring)."""
        self._k += 1
        b = Batch()
        self._chunk = self.long_prefill
        if self.long_prefill_sole_request and len(self.running) + len(self.waiting) <= 1:
            self._chunk = 0  # vLLM 0.31+: nobody to starve, the one request takes the budget
        budget = self._schedule_running(b, now)
        if not (b.preempted_recompute or b.preempted_swap):  # vLLM: no admissions after a preemption
            if self.swapped:
                budget = self._resume_swapped(b, budget, now)
            if self.waiting and not self.swapped:
                self._admit_waiting(b, budget, now)
        return b

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
        k, active, lazies = self._k, self.active, self.lazy
        woken = lazies.due(k)
        if woken:
            active.extend(woken)
            active.sort(key=_order)
        budget = self.max_tokens - lazies.n
        if lazies.n and budget < sum(x.seq.num_tokens - x.seq.num_computed_tokens for x in active):
            self.materialize(k)  # the budget binds: visit everyone, in order
            active, budget = self.active, self.max_tokens
        decodes, finishing = b.decodes, b.finishing
        alloc, la = self.m.allocate_slots, self.lookahead
        fast, bs, tables, decode_slot = self._fast_decode, self.m.block_size, self.m.req_blocks, self.m.decode_slot
        ctx = frag = counted = 0
        chunk = self._chunk
        i, end = 0, len(active)
        while i < end and budget > 0:
            live = active[i]
            i += 1
            if live.order < 0:  # preempted earlier in this step
                continue
            seq = live.seq
            c = seq.num_computed_tokens
            n = seq.num_tokens - c
            if n == 1 and fast and c >= seq.num_prompt_tokens:
                # NOTE: a decode token landing mid-block (not its first or last slot) in an
                # unshared block needs no block, copy or cache entry: allocate_slots would only
                # count a write. One landing on a block's first or last slot takes the manager's
                # decode path (a new block; caching the filled one). Either way nothing reads a
                # running sequence before complete(), so the token is computed and sampled here.
                r = c % bs
                if r and r < bs - 1:
                    in_place = tables[seq.seq_id][c // bs].ref_cnt == 1
                else:
                    got = decode_slot(seq)  # None: no free block (handled below); False: copy-on-write
                    in_place = got is not None and got is not False
                    counted += in_place  # the manager counted its write
                if in_place:
                    budget -= 1
                    last = min(bs - 2 - r, live.target - c - 3)  # steps this stays mid-block, after this one
                    if last > 0:
                        # Only a fork shares a partial block, and only at its prefill's end:
                        # this one stays unshared until it fills.
                        lazies.add(live, k, last)
                        continue
                    seq.num_computed_tokens = c + 1
                    seq.append_tokens(1)
                    decodes.append(live)
                    ctx += c + 1
                    if c + 2 >= live.target:
                        finishing.append(live)
                    elif r < bs - 1:
                        frag += bs - r - 2  # its last block's empty slots
                    continue
            if 0 < chunk < n:
                n = chunk
            if n > budget:
                n = budget
            if alloc(seq, n, 0, None, la) is None:
                was = lazies.n
                if not self._make_room(live, n, b, now):
                    if self.priority and live.seq.seq_id not in self.m.req_blocks:
                        # vLLM: it preempted itself; those after it may still fit
                        budget = self.max_tokens - sum(b.tokens)
                        continue
                    break
                budget += was - lazies.n  # lazy victims give their token back
                if self.priority:  # victims may have been ahead of it, and scheduled
                    budget = self.max_tokens - sum(b.tokens)
            self._add(b, live, n)
            budget -= n
        self.active = [x for x in active if x.order >= 0 and x.since < 0]
        nl = b.lazy = lazies.n
        if decodes or nl:
            self.m.ops.counts["write"] += len(decodes) + nl - counted
            b.decode_tokens += len(decodes) + nl
            b.context_tokens += ctx + lazies.context_tokens(k)
            b.frag = frag + lazies.empty_slots(k)
        return budget

    def materialize(self, k: int | None = None) -> None:
        """End all lazy decoding: every running sequence's `seq` is exact at the start of
        step `k` (default: the next step)."""
        if not self.lazy.n:
            return
        self.lazy.drop_all(self.running, self._k + 1 if k is None else k)
        self.active = list(self.running)

    def _make_room(self, live: Live, n: int, b: Batch, now: float) -> bool:
        """Preempt until `live`'s `n` tokens fit: True, or False if `live` itself was
        preempted (or dropped, when it is alone and still does not fit)."""
        running = self.running
        while True:
            victim = max(running, key=_priority_key) if self.priority else running[-1]
            if victim is live and len(running) == 1 and not b.num_seqs:
                running.pop()  # alone and still out of blocks: it can never fit
                if live.seq.num_output_tokens:
                    self._retire(live, TRUNCATED, "context_exceeds_cache", now)
                else:
                    self._retire(live, REJECTED, "prompt_exceeds_cache", now)
                return False
            if victim is running[-1]:
                running.pop()
            else:
                running.remove(victim)
            if victim.since >= 0:
                self.lazy.drop(victim, self._k)
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
        while self.swapped and budget > 0 and len(running) < self.max_seqs:
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
            if len(running) + width > self.max_seqs:
                break
            seq = live.seq if live.seq is not None else self._materialise(live)
            # vLLM allocate_slots(has_scheduled_reqs=bool(self.running)): the watermark
            # applies while anything runs; then blocks may also free up later
            held = bool(running)
            if held and self._blocked is not None and \
                    self._blocked.still(live, min(budget, self._chunk or budget), held):
                break
            blocks, hit = m.get_computed_blocks(seq)
            n = seq.num_tokens - hit
            if 0 < self._chunk < n:
                n = self._chunk
            if n > budget:
                if not self.chunked and held:
                    break  # the whole prompt must fit one step
                n = budget
            if m.allocate_slots(seq, n, hit, blocks, self.lookahead, watermark=held,
                                full_sequence_must_fit=True) is None:
                if held:  # FCFS head of line: wait for blocks to free
                    if self.skip_blocked_head and m.sliding_window is None:
                        self._blocked = BlockedHead(m, live, blocks, hit, n, self.lookahead, held)
                    break
                waiting.pop()  # nothing else holds blocks: it can never fit
                self._retire_never_fits(live, now)
                continue
            waiting.pop()
            self._admit(b, live, hit, n, now)
            budget -= n

    def _retire_never_fits(self, live: Live, now: float) -> None:
        """A waiting request that cannot fit even with nothing else holding blocks."""
        if live.seq.num_output_tokens:
            self._retire(live, TRUNCATED, "context_exceeds_cache", now)
        else:
            self._retire(live, REJECTED, "prompt_exceeds_cache", now)

    def _admit(self, b: Batch, live: Live, hit: int, n: int, now: float) -> None:
        """Run a waiting request whose `n` tokens after `hit` cached ones got slots; log a first admission."""
        seq = live.seq
        seq.num_computed_tokens = hit
        self._join(live)
        self._add(b, live, n)
        log, row = self.log, live.row
        if log.first_scheduled[row] != log.first_scheduled[row]:  # NaN: first admission
            log.first_scheduled[row] = now
            log.first_scheduled_step[row] = self.step
            log.hit_tokens[row] = hit
            b.admitted += 1
            b.admitted_prompt_tokens += seq.num_prompt_tokens
            b.admitted_hit_tokens += hit

    def _materialise(self, live: Live) -> Sequence:
        req = live.req
        live.seq = Sequence(req.id, req.prompt, uid=self._uid, output=req.output)
        self._uid += 1
        return live.seq

    # ------------------------------------------------------------- complete
    def complete(self, b: Batch, now: float) -> None:
        """Apply a step that ended at `now`: advance tokens, sample, fork, free the finished;
        then set `internal_fragmentation` over the running sequences."""
        log, la, bs = self.log, self.lookahead, self.m.block_size
        finished = list(b.finishing)
        frag, alive = b.frag, len(b.decodes) - len(finished) + b.lazy
        for live, n in zip(b.lives, b.tokens, strict=True):
            seq = live.seq
            c = seq.num_computed_tokens + n
            seq.num_computed_tokens = c
            t = seq.num_tokens
            seqs = 1
            if c == t:  # all known tokens computed: sample one
                seq.append_tokens(1)
                t += 1
                if c == seq.num_prompt_tokens:  # the request's first token
                    log.first_token[live.row] = now
                    log.first_token_step[live.row] = self.step
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
            for live in finished:
                self._retire(live, FINISHED, "", now)
            self.running = [x for x in self.running if x.order >= 0]
            self.active = [x for x in self.active if x.order >= 0]
        if alive != len(self.running):  # some running sequences were not scheduled
            self.materialize()
            frag = sum(self._fragmentation(x.seq) for x in self.running)
        self.internal_fragmentation = frag

    def _fragmentation(self, seq: Sequence) -> int:
        """Allocated slots of a running sequence not holding a token (see the NOTE in complete)."""
        bs = self.m.block_size
        return max(0, -(-(seq.num_computed_tokens + self.lookahead) // bs) * bs - seq.num_tokens)

    def _join(self, live: Live) -> None:
        """`live` joins RUNNING (at the back)."""
        live.order = self._joined
        self._joined += 1
        self.running.append(live)
        self.active.append(live)

    def _fork(self, live: Live) -> int:
        """Parallel sampling: the n - 1 other samples share the prompt's blocks (copy-on-write).
        Returns n, the sequences the request now runs."""
        req = live.req
        self._open[live.row] = req.n
        for j in range(1, req.n):
            child = Live(req, live.row, self.max_len)
            child.seq = self.m.fork(live.seq, f"{req.id}/{j}", self._uid)
            self._uid += 1
            self._join(child)
        return req.n

    def _retire(self, live: Live, status: int, reason: str, now: float) -> None:
        """A sequence is done (finished or dropped): free its blocks; when it is the
        request's last sample, close the request."""
        seq, row, log = live.seq, live.row, self.log
        live.order = -1
        if seq is not None:
            if seq.seq_id in self.m.req_blocks:
                self.m.free(seq)
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
        self.done.append(live.req)


def _priority_key(live: Live) -> tuple[int, float]:
    """The preemption victim is the running request with the largest key, the first such in
    RUNNING order (vLLM: `max(self.running, key=lambda r: (r.priority, r.arrival_time))`)."""
    return (live.req.priority, live.req.arrival)


def _order(live: Live) -> int:
    return live.order
