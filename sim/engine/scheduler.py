"""One engine step's scheduling decision, as vLLM 0.33's `Scheduler.schedule`; no simulated clock.

`schedule(now)` builds a batch under a token budget (`max_num_scheduled_tokens`, else
`max_num_batched_tokens`) and `max_num_seqs` (vllm/v1/core/sched/scheduler.py): one pass over RUNNING,
each sequence its decode token or next prefill chunk (capped by `long_prefill_token_threshold`),
preempting the newest running sequence when blocks run out (recompute: free and requeue at the front of
WAITING; swap, a v0/v2 option: move its blocks to CPU). A step that preempted admits nothing.
Otherwise swapped sequences come back while they can be swapped in, then one pass over WAITING in FCFS
(or priority) order, with a prefix-cache lookup, until RUNNING holds `max_num_active_seqs` (vLLM 0.31+;
default `max_num_seqs`) or the first one that cannot be allocated: its whole known context must fit
(`scheduler_reserve_full_isl`, on by default; off, its chunk), and while any request runs the
watermark stays free. `update(batch, now)` applies the step's output.

What varies is held, not subclassed (as vLLM's own `Scheduler` holds `self.connector`):
- the output mode (`sim.engine.output`: `SyncOutput` or `AsyncOutput`): sync, or async with output placeholders (vLLM's
  `AsyncScheduler`); its placeholder rules in the RUNNING pass are no-ops in sync, as in vLLM;
- the KV connector (`sim.engine.offload_connector`, KV offloading; None without): it continues a
  fresh admission's hit into its tier, holds a request whose KV loads, hears of preemptions and
  finishes, and is offered what each step computed;
- the prefill rules (`sim.engine.prefill`: the long-prefill cap and the prefill cadence), built
  from the release profile of `cfg.vllm_version`;
- the exact speed shortcuts (`sim.engine.shortcuts`: lazy decodes and the blocked head), on only
  with no connector (or the NIXL one); the async output takes the blocked head and, with no
  connector, lazy decodes of its own (`AsyncLazy`).

A request with n > 1 arrives as n requests (vLLM 0.33's fan-out, `fan_out`), or, v0-style, runs as
one sequence whose samples fork after its prefill (`SimConfig.parallel_sampling = "fork"`); either
way its samples share its row in the log, which closes when the last of them is done.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import replace

from kvsim.kvcache.admission import AllocStatus
from kvsim.kvcache.mamba import aligned_chunk
from kvsim.kvcache.manager import KVCacheManager, cdiv
from kvsim.kvcache.profiles import profile
from kvsim.kvcache.sequence import Sequence
from kvsim.sim.engine.batch import Batch, Live
from kvsim.sim.engine.config import SimConfig
from kvsim.sim.engine.metrics import FINISHED, REASON_CODE, REJECTED, TRUNCATED, RequestLog
from kvsim.sim.engine.output import AsyncOutput, SyncOutput
from kvsim.sim.engine.prefill import PrefillRules
from kvsim.sim.engine.shortcuts import Shortcuts
from kvsim.sim.engine.wait_queue import WaitQueue
from kvsim.workloads.request import Request

__all__ = ["Batch", "Live", "Scheduler", "WaitQueue", "fan_out"]  # Batch, Live, WaitQueue: re-exported


def fan_out(req: Request) -> list[Request]:
    """The requests vLLM's front end makes of `req`: itself if n = 1, else n requests "{j}_{id}"
    with n = 1 (vllm/v1/engine/parallel_sampling.py ParentRequest.get_child_info)."""
    return [req] if req.n == 1 else [replace(req, id=f"{j}_{req.id}", n=1) for j in range(req.n)]


class Scheduler:
    """The WAITING / RUNNING / SWAPPED queues over one KV-cache manager, with its collaborators."""

    def __init__(self, cfg: SimConfig, manager: KVCacheManager, log: RequestLog, *, connector=None):
        self.m = manager
        self.log = log
        self.connector = connector  # sim.engine.offload_connector.OffloadConnector, or None
        self.max_seqs = cfg.batch_limits()[1]
        self.max_tokens = cfg.step_tokens()  # a step's token budget
        self.chunked = cfg.enable_chunked_prefill
        self.swap = cfg.preemption == "swap"
        self.priority = cfg.scheduling == "priority"
        self.fork = cfg.parallel_sampling == "fork"  # else n > 1 fans out
        self.lookahead = cfg.num_lookahead_tokens
        self.max_len = cfg.max_model_len
        self.prefill = PrefillRules(cfg, profile(cfg.vllm_version))  # the release's rules, from the config
        self._chunk = self.prefill.long_prefill  # this step's cap on a request's chunk (0: none), see schedule
        # Mamba groups in align mode: (block size, checkpoint alignment); chunks end on block
        # boundaries (kvcache.mamba.aligned_chunk), within the configured chunk limit
        self.mamba = getattr(manager, "mamba_split", None)
        # a connector that completes divergent hybrid hits (the NIXL one) is given the manager's
        # per-group lookup (vLLM `Scheduler._get_local_prefix_cache_hit`); a hybrid manager has it
        self._divergent_lookup = manager.get_computed_blocks_for_connector \
            if self.mamba is not None and getattr(connector, "divergent_hits", False) else None
        limit = self.prefill.long_prefill
        self.max_prefill = min(self.max_tokens, limit) if limit > 0 else self.max_tokens
        self.max_active = cfg.max_num_active_seqs or self.max_seqs  # admissions into RUNNING stop here
        self.whole_fit = cfg.scheduler_reserve_full_isl  # a WAITING request's whole known context must fit
        self.output = AsyncOutput(self) if cfg.runs_async else SyncOutput(self)
        # (a connector that reads no running sequence between its admissions, the NIXL one, keeps them;
        # with KV events each cache stays in its step, `Shortcuts`)
        on = cfg.shortcuts and (connector is None or getattr(connector, "allows_shortcuts", False))
        self.last_batch = Batch()  # the batch scheduled last (under async output, in flight while the next is chosen)
        # the async output's lazy decodes (`AsyncLazy`) bring a sequence up to date in the batch in flight
        last = (lambda: self.last_batch) if cfg.runs_async and connector is None \
            and not cfg.debug_invariants else None
        self.fast = Shortcuts(manager, on, self.lookahead, self.priority, whole_fit=self.whole_fit,
                              decodes_fit=self.max_seqs <= self.max_tokens, lazy=self.output.shortcuts,
                              last_batch=last)
        if connector is not None and on and self.output.shortcuts:
            connector.free_seq = self.fast.free  # its held blocks go back as a finished request's do
        self.waiting = WaitQueue(self.priority)
        self.running: list[Live] = []
        self._joined = 0  # lives that joined RUNNING so far (their `order`)
        self.steps_scheduled = 0  # steps scheduled so far
        self.step = 0  # the engine's number for the step being scheduled (logged per request)
        self.swapped: list[tuple[int, int, Live]] = []  # heap by arrival: the oldest resumes first
        self.done: list[Request] = []  # requests finished or dropped since the caller last drained it
        self._open: dict[int, int] = {}  # row -> samples not yet done, of a request with n > 1
        self._uid = 0  # sequence uids handed out so far (`add`)
        self._finished = False  # vLLM's finished_req_ids: some request finished since the last batch
        self.internal_fragmentation = 0  # allocated slots not holding a token, after `update`
        # vLLM 0.33 Scheduler.__init__ (defer_block_free): with batches in flight (async output) and a
        # connector that may load into freed blocks (a KV consumer; offloading runs as kv_both), a
        # request's blocks go back to the pool only once the steps that wrote them are processed
        self.defer_frees = cfg.runs_async and connector is not None
        self.sched_seq = 0  # steps with tokens scheduled (vLLM sched_step_seq)
        self.processed_seq = 0  # of those, the ones whose output was applied (processed_step_seq)
        self._deferred: deque[tuple[int, list]] = deque()  # (fence, blocks) awaiting their step

    # ------------------------------------------------------------- state
    def has_work(self) -> bool:
        """Requests running, waiting, swapped or held by the connector, or its transfers in flight."""
        return bool(self.running or self.waiting or self.swapped) or \
            (self.connector is not None and self.connector.has_work())

    def has_requests(self) -> bool:
        """vLLM `Scheduler.has_requests`: requests left, or some finished since the last batch."""
        return self.has_work() or self._finished

    def eligible(self) -> int:
        """Requests running or waiting (vLLM `get_request_counts`, summed; requests holding blocks
        for a load count as waiting)."""
        n = len(self.running) + len(self.waiting)
        return n if self.connector is None else n + len(self.connector.holding)

    def in_flight(self, now: float) -> bool:
        """Whether the connector has a transfer in flight at `now` (async output: an empty batch then
        does not count toward a stall)."""
        return self.connector is not None and self.connector.in_flight(now)

    def idle_until(self, now: float) -> float | None:
        """A step at `now` scheduled nothing: when to schedule again (the connector's transfers), or
        None: no progress is possible."""
        return None if self.connector is None else self.connector.idle_until(now)

    # ------------------------------------------------------------- arrivals
    def add(self, req: Request, now: float) -> None:
        """A request arrives: queue it (fanned out if n > 1), or drop it at once if it can never run."""
        self.output.check(req)
        row = self.log.add(req.id, now, req.prompt_len, req.output_len, req.n, req.priority)
        # NOTE: n sequence uids a request, in arrival order, so its decoded tokens' stand-ins (and the
        # keys of blocks holding them) are the request's own, not the admission order's (priority
        # scheduling admits out of order); as `kvcache.replay` and the conform drivers number them
        uid = self._uid
        self._uid += req.n
        reason = self._never_fits(req)
        if reason:
            self.log.status[row] = REJECTED
            self.log.reason[row] = REASON_CODE[reason]
            self.log.finish[row] = now
            self.done.append(req)
            return
        if req.n == 1 or self.fork:  # (a fork's children take the uids after its own)
            live = Live(req, row, self.max_len)
            live.arrival, live.uid = now, uid
            self.waiting.push(live)
            return
        self._open[row] = req.n
        for j, sample in enumerate(fan_out(req)):
            live = Live(sample, row, self.max_len)
            live.parent, live.arrival, live.uid = req, now, uid + j
            self.waiting.push(live)

    def _never_fits(self, req: Request) -> str:
        if req.prompt_len == 0:
            return "empty_prompt"
        if self.max_len is not None and req.prompt_len >= self.max_len:
            return "prompt_exceeds_max_model_len"
        if self.fork and req.n > self.max_active:  # its samples are admitted together
            return "n_exceeds_max_num_seqs"
        if not self.chunked and req.prompt_len > self.max_tokens:
            return "prompt_exceeds_batch"
        if self.m.sliding_window is None and cdiv(req.prompt_len, self.m.block_size) > self.m.num_usable_blocks:
            return "prompt_exceeds_cache"
        return ""

    def fork_samples(self, live: Live) -> int:
        """v0 parallel sampling: the n - 1 other samples share the prompt's blocks (copy-on-write).
        Returns n, the sequences the request now runs."""
        req = live.req
        self._open[live.row] = req.n
        for j in range(1, req.n):
            child = Live(req, live.row, self.max_len)
            child.arrival = live.arrival
            child.admitted = True  # its prompt came with the fork: a later re-admission is not a first one
            child.uid = live.uid + j
            child.seq = self.m.fork(live.seq, f"{req.id}/{j}", child.uid)
            self._join(child)
        return req.n

    # ------------------------------------------------------------- schedule
    def schedule(self, now: float) -> Batch:
        """Choose this step's batch and allocate its slots (see the module docstring)."""
        self.steps_scheduled += 1
        conn, prefill = self.connector, self.prefill
        if conn is not None:
            conn.begin_step(now)
        b = Batch(start=now, k=self.steps_scheduled)
        if self.mamba is not None:
            self.m.new_step_starts()
        self._chunk = prefill.chunk_cap(self.eligible()) if prefill.long_prefill else 0
        cadence = prefill.cadence is not None
        if cadence:
            prefill.hold(self.running)
        # a step at which every running sequence decodes lazily skips the RUNNING pass (the engine
        # takes runs of them in a loop of its own, `sim.engine.async_quiet`)
        fast, k = self.fast, self.steps_scheduled
        if fast.lazy_only(k, self.max_tokens):
            budget = fast.lazy_step(b, k, self.max_tokens)  # no one to visit: the pass's totals alone
        else:
            budget = self._schedule_running(b, now)
        if not (b.preempted_recompute or b.preempted_swap):  # vLLM: no admissions after a preemption
            if self.swapped:
                budget = self._resume_swapped(b, budget, now)
            if (self.waiting or (conn is not None and conn.holding)) and not self.swapped:
                self._admit_waiting(b, budget, now)
            if cadence:
                prefill.released(self.eligible() - len(self.running))
        if cadence:
            prefill.end(b)
        if conn is not None:  # it offers what each scheduled sequence will have computed
            conn.end_step(b, now)
        if self.defer_frees and b.lives:
            self.sched_seq += 1
        self.output.after_schedule(b)
        self._finished = False
        self.last_batch = b
        return b

    def lazy_batch(self, now: float) -> Batch:
        """`schedule`, for a step at which the caller knows the RUNNING pass visits no one
        (`Shortcuts.lazy_only`), with WAITING and the swapped list empty, no connector or prefill
        cadence (`sim.engine.async_quiet`): the pass's lazy totals are the batch, and `after_schedule`
        has no member to advance. A Mamba group's hits hashed in the last step are takeable again,
        as `schedule` begins."""
        b = Batch(start=now, k=self.steps_scheduled + 1)
        self.scheduled_lazily(b)
        self.fast.lazy_step(b, b.k, self.max_tokens)
        return b

    def offer_rest(self, b: Batch, budget: int, now: float) -> None:
        """The end of `schedule` for batch `b`, whose RUNNING pass the caller took without preempting
        (`sim.engine.async_quiet`: async output, no connector, prefill cadence, Mamba chunking or swap):
        WAITING is offered the `budget` left, and the batch goes to the output."""
        prefill = self.prefill
        self._chunk = prefill.chunk_cap(self.eligible()) if prefill.long_prefill else 0
        if self.waiting:
            self._admit_waiting(b, budget, now)
        self.output.after_schedule(b)
        self._finished = False
        self.last_batch = b

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
                b.chunks.append((c, n))
            else:
                b.chunks.remove((c, n))
        if sign > 0:
            b.lives.append(live)
            b.tokens.append(n)
        else:
            k = b.lives.index(live)
            del b.lives[k], b.tokens[k]

    def _schedule_running(self, b: Batch, now: float) -> int:
        """vLLM's RUNNING loop: each sequence asks for its known tokens plus placeholders less those
        computed; one whose in-flight output reaches max_tokens is skipped (placeholders exist only
        with async output), and none asks past max_model_len."""
        k, fast, m = self.steps_scheduled, self.fast, self.m
        budget = fast.begin(k, self.max_tokens, self.running)
        active, decode = fast.active, fast.decodes and fast.decode
        lazy_after = fast.async_decodes
        alloc, la, max_len = m.allocate_slots, self.lookahead, self.max_len
        cache = m.cache_blocks if self.output.caches_known else None
        # a one-token chunk's slot straight from `decode_slot`, which `allocate_slots` calls first for it
        # (one group, no window, no lookahead: every running request, every step, under async output)
        slot = m.decode_slot if not la and m.num_groups == 1 and m.sliding_window is None else None
        prefill = self.prefill
        chunk, hold = self._chunk, prefill.held
        i, end = 0, len(active)
        while i < end and budget > 0:
            live = active[i]
            i += 1
            if live.order < 0 or (hold and live.prefilling):  # preempted earlier in this step, or held back
                continue
            seq = live.seq
            c = seq.num_computed_tokens
            ph = live.ph
            if ph and c + 2 - ph >= live.limit:
                continue  # its in-flight output reaches max_tokens
            n = seq.num_tokens + ph - c
            if n == 1 and decode and c >= seq.num_prompt_tokens and decode(b, live, c, k):
                budget -= 1
                if live.prefilling:  # a resumed sequence's last known token: the end of its prefill
                    prefill.carried, live.prefilling = True, False
                continue
            if 0 < chunk < n:
                n = chunk
            if n > budget:
                n = budget
            if max_len is not None and n > max_len - c - 1:
                n = max_len - c - 1
            if self.mamba is not None:  # vLLM: a request left with 0 tokens is skipped this step
                n = self._mamba_chunk(seq, c, n)
            if n <= 0:
                continue
            got = slot(seq) if n == 1 and slot is not None else False
            if got is False:  # (its in-flight tokens: a window lets go on the processed ones; 0 under sync output)
                got = alloc(seq, n, 0, None, la, in_flight=live.inflight)
            if got is None:
                was = fast.lazy.n
                if not self._make_room(live, n, b, now):
                    if self.priority and not m.holds_blocks(seq.seq_id):
                        # vLLM: it preempted itself; those after it may still fit
                        budget = self.max_tokens - sum(b.tokens)
                        continue
                    break
                budget += was - fast.lazy.n  # lazy victims give their token back
                if self.priority:  # victims may have been ahead of it, and scheduled
                    budget = self.max_tokens - sum(b.tokens)
            if cache is not None:
                cache(seq, min(c + n, seq.num_tokens))
            self._add(b, live, n)
            if lazy_after and n == 1 and c >= seq.num_prompt_tokens:
                fast.after(live, c, k)
            budget -= n
            if live.prefilling:
                prefill.carried = True
        fast.end(b, k)
        return budget

    def scheduled_lazily(self, b: Batch) -> None:
        """Steps up to `b`'s, each of lazy decodes alone, were scheduled (`lazy_batch`'s one, or a
        stretch of them, `AsyncQuietRuns._stretch`): the step count, the batch in flight and a Mamba
        group's same-step hits as `schedule` leaves them."""
        self.steps_scheduled = b.k
        if self.mamba is not None:
            self.m.new_step_starts()
        self._finished = False
        self.last_batch = b

    def quiet_step(self) -> int:
        """A step the quiet runs take without `schedule` (sim.engine.quiet): its number."""
        self.steps_scheduled += 1
        return self.steps_scheduled

    def materialize(self, k: int | None = None) -> None:
        """End all lazy decoding: every running `seq` is exact at the start of step `k` (default: the next)."""
        self.fast.materialize(self.running, self.steps_scheduled + 1 if k is None else k)

    def _make_room(self, live: Live, n: int, b: Batch, now: float) -> bool:
        """Preempt until `live`'s `n` tokens fit: True, or False if `live` itself was preempted (or
        dropped, when it is alone and still does not fit), or the next victim's blocks would come
        back only once a step in flight is processed (vLLM `schedule`, `_request_blocks_can_be_freed`)."""
        running, conn = self.running, self.connector
        while True:
            victim = max(running, key=_priority_key) if self.priority else running[-1]
            if self.defer_frees and victim.last_seq > self.processed_seq:
                return False  # vLLM: "a deferred free will not help with immediate allocation"
            if victim is live and len(running) == 1 and not b.num_seqs \
                    and not (conn is not None and conn.holding) and not self._deferred:
                # NOTE: requests holding blocks for a load, or blocks whose free is deferred, may
                # come back: then it preempts itself as vLLM does, rather than "never fitting"
                running.pop()  # alone and still out of blocks: it can never fit
                self._retire_never_fits(live, now)
                return False
            if victim is running[-1]:
                running.pop()
            else:
                running.remove(victim)
            self.fast.preempted(victim, self.steps_scheduled)
            if self.priority and victim in b.lives:  # scheduled earlier this step: undo that
                self._add(b, victim, b.tokens[b.lives.index(victim)], -1)
            self._preempt(victim, b)
            if victim is live:
                return False
            if self.m.allocate_slots(live.seq, n, 0, None, self.lookahead, in_flight=live.inflight) is not None:
                return True

    def _preempt(self, live: Live, b: Batch) -> None:
        """vLLM `_preempt_request`: recompute (free, back to the front of WAITING; computed tokens and
        placeholders reset, in-flight output stale), or v0's swap to CPU blocks."""
        seq = live.seq
        live.order = -1
        self.log.preemptions[live.row] += 1
        if self.connector is not None:
            self.connector.preempted(live)
        if self.swap and self.m.can_swap_out([seq]):
            self.m.swap_out([seq])
            heapq.heappush(self.swapped, (live.row, live.seq.uid, live))
            b.preempted_swap += 1
        else:
            self._free(live)
            seq.num_computed_tokens = 0
            live.stale, live.ph = live.inflight, 0
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
                self.m.drop_swapped(live.seq)
                self.retire(live, TRUNCATED, "context_exceeds_cache", now)
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

    def _admit_waiting(self, b: Batch, budget: int, now: float) -> None:
        """vLLM's WAITING loop. With a connector, requests holding blocks for a load are served
        first (vLLM's `WAITING_FOR_REMOTE_KVS`): one whose load has not landed is skipped; a fresh
        request's GPU hit continues into the connector's tier, and one with tokens to load takes its
        blocks, starts the load and is held. A request with stale output in flight (async), or that
        the connector cannot answer yet, is skipped for the step; skipped requests go back to the
        front in their order (vLLM `prepend_requests`)."""
        m, running, conn, prefill = self.m, self.running, self.connector, self.prefill
        holding = conn.holding if conn is not None else None
        skipped_holding: list[Live] = []
        skipped_waiting: list[Live] = []
        while budget > 0:
            queue = holding if holding else self.waiting
            if not queue:
                break
            live = queue.peek()
            width = live.req.n if live.seq is None else 1
            if len(running) + width > self.max_active:
                break
            if live.stale:  # its stale output may still finish it: come back after that
                skipped_waiting.append(queue.pop())
                prefill.skipped(live)
                continue
            held = bool(running)  # vLLM allocate_slots(has_scheduled_reqs=...): the watermark applies
            seq = live.seq if live.seq is not None else self._materialise(live)
            blocks = None
            if queue is holding:
                hit = conn.landed(seq)
                if hit is None:  # its load has not landed
                    skipped_holding.append(queue.pop())
                    prefill.skipped(live)
                    continue
            else:
                if held and self.fast.head_blocked(live, min(budget, self._chunk or budget)):
                    break
                if self._divergent_lookup is not None:
                    blocks, hit, diverged = self._divergent_lookup(seq)
                else:
                    (blocks, hit), diverged = m.get_computed_blocks(seq), False
                if conn is not None:
                    ext = conn.lookup(seq, hit)
                    if ext is None:  # the connector cannot answer yet
                        skipped_waiting.append(queue.pop())
                        prefill.skipped(live)
                        continue
                    if diverged and not ext:  # nothing loaded backs full attention's deeper hit: reconcile
                        blocks, hit = m.get_computed_blocks(seq)
                    if ext:
                        if not conn.start_load(live, hit, blocks, ext, watermark=held, whole=self.whole_fit):
                            break
                        queue.pop()
                        skipped_holding.append(live)  # it holds blocks now
                        prefill.skipped(live)
                        continue
            if prefill.held and hit < seq.num_tokens - 1:  # the cadence holds prompts back (loads still start)
                break
            n = self._admission_tokens(seq, hit, budget, held)
            if n and self.mamba is not None:
                n = self._mamba_chunk(seq, hit, n)
            if not n:
                break
            got = m.allocate_slots(seq, n, 0 if blocks is None else hit, blocks, self.lookahead, watermark=held,
                                   full_sequence_must_fit=self.whole_fit)
            if got is None:
                # NOTE: requests holding blocks for a load (popped into skipped_holding meanwhile)
                # hold them as running ones do: vLLM waits for them, nothing "never fits"
                if held or skipped_holding or (holding and len(holding) > (queue is holding)) or self._deferred \
                        or (conn is not None and conn.holds_finished()):
                    if held and blocks is not None:  # FCFS head of line: wait for blocks to free
                        self.fast.block_head(live, blocks, hit, n)
                    break
                queue.pop()  # nothing else holds blocks: it can never fit
                self._retire_never_fits(live, now)
                continue
            queue.pop()
            first = not live.admitted
            self._admit(b, live, hit, n, now)
            if conn is not None:
                loaded = conn.admitted(live, hit, n, first)
                if loaded:  # the log counts the GPU hit; the rest came from the connector's tier
                    b.admitted_hit_tokens -= loaded
                    self.log.hit_tokens[live.row] -= loaded
            budget -= n
        if skipped_holding or skipped_waiting:
            for queue, lives in ((holding, skipped_holding), (self.waiting, skipped_waiting)):
                for live in reversed(lives):  # back at the front, in their order (vLLM prepend_requests)
                    queue.push(live, front=True)

    def _admission_tokens(self, seq: Sequence, hit: int, budget: int, held: bool) -> int:
        """Tokens a waiting `seq` with `hit` computed takes this step (its rest, capped by the chunk and
        the budget); 0: without chunked prefill its prompt must fit one step while others run."""
        n = self._chunk if 0 < self._chunk < seq.num_tokens - hit else seq.num_tokens - hit
        if n > budget:
            return 0 if not self.chunked and held else budget
        return n

    def _mamba_chunk(self, seq: Sequence, start: int, n: int) -> int:
        """`n` tokens from `start` cut as vLLM's `Scheduler._mamba_block_aligned_split` cuts them."""
        bs, alignment = self.mamba
        return aligned_chunk(start, n, seq.num_prompt_tokens, seq.num_tokens, self.m.junctions.get(seq.seq_id, 0),
                             bs, alignment, self.max_prefill)

    def _retire_never_fits(self, live: Live, now: float) -> None:
        """A request that cannot fit even with nothing else holding blocks: truncated once it has output."""
        dropped = (TRUNCATED, "context_exceeds_cache") if live.seq.num_output_tokens else (REJECTED, "prompt_exceeds_cache")
        self.retire(live, *dropped, now)

    def _admit(self, b: Batch, live: Live, hit: int, n: int, now: float) -> None:
        """Run a waiting request whose `n` tokens after `hit` cached ones got slots; log a first admission."""
        seq = live.seq
        seq.num_computed_tokens = hit
        if self.prefill.cadence is not None:
            self.prefill.admitted(live, hit)
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
        live.seq = Sequence(r.id, r.prompt, uid=live.uid, output=r.output, keys=live.keys)
        return live.seq

    # ------------------------------------------------------------- output
    def launched(self, b: Batch, end: float) -> None:
        """Batch `b` is handed to the device and will end at `end` (its start, without a forward): with
        batches in flight, the connector's worker starts the loads it planned to land then."""
        if self.connector is not None:
            self.connector.launched(b, end)

    def update(self, b: Batch, now: float) -> None:
        """The output of batch `b` arrives at `now` (the output mode applies it; vLLM
        `update_from_output`); the connector hears that the step ended."""
        self.output.update(b, now)
        if self.connector is not None:
            self.connector.step_ended(b, now)

    def _free(self, live: Live) -> None:
        """Free `live`'s blocks, or, while a step that scheduled it is in flight, hold them until it
        is processed (vLLM `_free_request_blocks`, `_request_blocks_can_be_freed`)."""
        if self.defer_frees and live.last_seq > self.processed_seq:
            self._deferred.append((self.sched_seq, self.m.pop_blocks_for_free(live.seq)))
        else:
            self.fast.free(live.seq)

    def processed(self) -> None:
        """A step with tokens had its output applied: the deferred blocks whose fence it reaches go
        back to the pool, in order, up to the first still fenced (vLLM `_drain_deferred_frees`)."""
        self.processed_seq += 1
        deferred = self._deferred
        while deferred and deferred[0][0] <= self.processed_seq:
            self.m.free_popped(deferred.popleft()[1])

    def finish(self, lives: list[Live], now: float) -> None:
        """`lives` (in RUNNING order) sampled their last tokens in the step that ended at `now`."""
        for live in lives:
            self.retire(live, FINISHED, "", now)
        self.drop_retired()

    def drop_retired(self) -> None:
        """RUNNING (and the shortcuts' visiting list) without the sequences retired meanwhile."""
        self.running = [x for x in self.running if x.order >= 0]
        self.fast.active = [x for x in self.fast.active if x.order >= 0]

    def fragmentation(self, seq: Sequence) -> int:
        """Allocated slots of a running sequence not holding a token (see SyncOutput.update)."""
        return max(0, cdiv(seq.num_computed_tokens + self.lookahead, self.m.block_size) * self.m.block_size
                   - seq.num_tokens)

    def _join(self, live: Live) -> None:
        """`live` joins RUNNING (at the back)."""
        live.order = self._joined
        self._joined += 1
        self.running.append(live)
        self.fast.active.append(live)

    def retire(self, live: Live, status: int, reason: str, now: float) -> None:
        """A sequence is done (finished or dropped): free its blocks; when it is the
        request's last sample, close the request."""
        seq, row, log = live.seq, live.row, self.log
        live.order = -1
        live.fin = True
        self._finished = True
        self.prefill.forget(live)
        if seq is not None:
            held = self.connector is not None and self.connector.retiring(live, status in (FINISHED, TRUNCATED), now)
            if not held and self.m.holds_blocks(seq.seq_id):
                self._free(live)
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
    RUNNING order (vLLM: `max(self.running, key=lambda r: (r.priority, r.arrival_time))`; the arrival
    is when the request reached the engine, `Live.arrival`)."""
    return (live.req.priority, live.arrival)
