"""Async scheduling: batch k+1 is scheduled while batch k runs, as vLLM 0.33.0's `AsyncScheduler`.

`schedule(now)` chooses a batch as `Scheduler.schedule` does but before the
previous batch's output is known, and advances each scheduled sequence at
once; `apply(batch, now)` delivers that batch's sampled tokens later (the
engine keeps two batches in flight, `Engine._async_steps`). No shortcut of the
synchronous scheduler applies (`sim.engine.shortcuts`): every running
sequence is visited every step. The rules, each from vLLM 0.33.0:

- Computed tokens advance when a batch is scheduled, and a batch that ends a
  request's known tokens adds an output placeholder (the token it will
  sample): vllm/v1/core/sched/scheduler.py `Scheduler._update_after_schedule`,
  vllm/v1/core/sched/async_scheduler.py `AsyncScheduler._update_after_schedule`.
- A running request asks for known tokens + placeholders - computed; it is
  skipped while its in-flight output will reach max_tokens (placeholders > 0
  and computed + 2 - placeholders >= prompt + max_tokens), or when no token is
  left under max_model_len: `Scheduler.schedule`, the RUNNING loop.
- Slots are allocated for the computed tokens, and blocks cached only up to
  the known tokens (`KVCacheManager.allocate_slots`, `num_tokens_to_cache`);
  when a running request's output arrives its blocks are cached up to computed
  - in-flight tokens (`Scheduler.update_from_output`, `cache_blocks`).
- A request stays in RUNNING, holding its blocks, until the output that
  finishes it is applied (`update_from_output`, `_free_request`): it counts
  against max_num_seqs and is the newest-request preemption victim like any.
- Preemption resets computed tokens and placeholders and marks the in-flight
  output stale (`Scheduler._preempt_request`); stale output still appends its
  tokens and may finish the waiting request, which then leaves WAITING
  (`update_from_output`, `_update_request_with_output(is_stale=True)`), and a
  request with stale output in flight is skipped, not waited for, by the
  WAITING scan (`Scheduler.schedule`, `skip_request`; skipped requests go back
  to the front in their order, `FCFSRequestQueue.prepend_requests`).
- The engine asks for a batch while the scheduler has requests or finished
  some since the last batch (`Scheduler.has_requests`, `has_finished_requests`).

One sequence per request (vLLM V1 fans out n > 1 in its front end) and
recompute preemption only; no lookahead slots or sliding window.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcache.manager import KVCacheManager
from sim.engine.batch import Batch, Live
from sim.engine.config import ConfigError, SimConfig
from sim.engine.metrics import FINISHED, RequestLog
from sim.engine.scheduler import Scheduler
from workloads.request import Request


class AsyncLive(Live):
    """A running sequence with vLLM's async counters."""

    __slots__ = ("ph", "inflight", "stale", "fin", "limit")

    def __init__(self, req: Request, row: int, max_len: int | None = None):
        super().__init__(req, row, max_len)
        self.ph = 0  # num_output_placeholders: sampled tokens in flight
        self.inflight = 0  # num_in_flight_tokens: scheduled tokens whose batch is not applied
        self.stale = 0  # num_stale_output_tokens: in-flight tokens from before a preemption
        self.fin = False  # finished or dropped: later outputs are ignored
        self.limit = req.prompt_len + max(req.output_len, 1)  # prompt + max_tokens


@dataclass(slots=True)
class AsyncBatch(Batch):
    """A batch and, per sequence, whether its runner samples a token (not a partial prefill)."""

    sampled: list[bool] = field(default_factory=list)


class AsyncScheduler(Scheduler):
    """vLLM's AsyncScheduler: `schedule` and `apply` split (see the module docstring)."""

    has_shortcuts = False
    live_type = AsyncLive

    def __init__(self, cfg: SimConfig, manager: KVCacheManager, log: RequestLog):
        super().__init__(cfg, manager, log)
        if self.swap:
            raise ConfigError("async_scheduling needs preemption='recompute' (vLLM V1 has no swap)")
        if self.lookahead:
            raise ConfigError("async_scheduling does not model lookahead slots (num_lookahead_tokens must be 0)")
        if manager.sliding_window is not None:
            raise ConfigError(f"async_scheduling does not model a sliding window (got {manager.sliding_window})")
        self._finished = False  # vLLM's finished_req_ids: some request finished since the last batch

    def add(self, req: Request, now: float) -> None:
        if req.n != 1 and self.fork:
            raise ConfigError(f"request {req.id!r}: n={req.n}; async scheduling does not fork samples (parallel_sampling='fork')")
        super().add(req, now)

    def has_requests(self) -> bool:
        """vLLM `Scheduler.has_requests`: requests left, or some finished since the last batch."""
        return bool(self.running or self.waiting) or self._finished

    # ------------------------------------------------------------- schedule
    def schedule(self, now: float) -> AsyncBatch:
        self._k += 1
        b = AsyncBatch()
        self._chunk = self.chunk_cap(self._eligible())
        cadence = self.cadence is not None
        if cadence:
            self._hold()
        budget = self._schedule_running(b, now)
        if not b.preempted_recompute:
            self._admit_waiting(b, budget, now)
            if cadence:
                self._released()
        if cadence:
            self._end_prefill(b)
        # vLLM _update_after_schedule: computed tokens advance now; a chunk that reaches the
        # known tokens plus placeholders samples one more (a placeholder)
        for live, n in zip(b.lives, b.tokens, strict=True):
            seq = live.seq
            c = seq.num_computed_tokens + n
            seq.num_computed_tokens = c
            live.inflight += n
            sampled = c >= seq.num_tokens + live.ph
            b.sampled.append(sampled)
            live.prefilling = not sampled  # vLLM is_prefill_chunk
            if sampled:
                live.ph += 1
        self._finished = False
        self.fast.active.clear()  # the synchronous scheduler's visiting list; unused here
        return b

    def _schedule_running(self, b: Batch, now: float) -> int:
        budget = self.max_tokens
        chunk, max_len, alloc, hold = self._chunk, self.max_len, self.m.allocate_slots, self.prefill_held
        for live in list(self.running):
            if budget <= 0:
                break
            if live.order < 0:  # preempted earlier in this step
                continue
            seq = live.seq
            c = seq.num_computed_tokens
            if live.ph and c + 2 - live.ph >= live.limit:
                continue  # its in-flight output reaches max_tokens
            if hold and live.prefilling:  # the cadence holds its chunk back
                continue
            n = seq.num_tokens + live.ph - c
            if 0 < chunk < n:
                n = chunk
            if n > budget:
                n = budget
            if max_len is not None and n > max_len - c - 1:
                n = max_len - c - 1
            if n <= 0:
                continue
            if alloc(seq, n) is None:
                if not self._make_room(live, n, b, now):
                    if self.priority and live.seq.seq_id not in self.m.req_blocks:
                        budget = self.max_tokens - sum(b.tokens)  # it preempted itself
                        continue
                    break
                if self.priority:
                    budget = self.max_tokens - sum(b.tokens)
            self.m.cache_blocks(seq, min(c + n, seq.num_tokens))
            self._add(b, live, n)
            budget -= n
            if live.prefilling:
                self._prefilled = True
        return budget

    def _preempt(self, live: Live, b: Batch) -> None:
        seq = live.seq
        live.order = -1
        self.log.preemptions[live.row] += 1
        self.m.free(seq)
        seq.num_computed_tokens = 0
        live.stale, live.ph = live.inflight, 0
        self.waiting.push(live, front=True)
        b.preempted_recompute += 1

    def _admit_waiting(self, b: Batch, budget: int, now: float) -> None:
        m, running, waiting = self.m, self.running, self.waiting
        skipped: list[Live] = []
        while waiting and budget > 0:
            if len(running) >= self.max_active:
                break
            live = waiting.peek()
            if live.stale:  # its stale output may still finish it: come back after that
                skipped.append(waiting.pop())
                self._skipped(live)
                continue
            seq = live.seq if live.seq is not None else self._materialise(live)
            held = bool(running)
            blocks, hit = m.get_computed_blocks(seq)
            if self.prefill_held and hit < seq.num_tokens - 1:  # the cadence holds prompts back
                break
            n = self._admission_tokens(seq, hit, budget, held)
            if not n:
                break
            if m.allocate_slots(seq, n, hit, blocks, watermark=held, full_sequence_must_fit=self.whole_fit) is None:
                if held:
                    break
                waiting.pop()  # nothing else holds blocks: it can never fit
                self._retire_never_fits(live, now)
                continue
            waiting.pop()
            self._admit(b, live, hit, n, now)
            budget -= n
        for live in reversed(skipped):
            waiting.push(live, front=True)

    # ---------------------------------------------------------------- apply
    def apply(self, b: AsyncBatch, now: float) -> None:
        """The batch's output arrives at `now` (vLLM `update_from_output`): sampled tokens are
        appended, placeholders resolved, blocks cached, and finished requests freed."""
        log = self.log
        stopped = False
        for live, n, sampled in zip(b.lives, b.tokens, b.sampled, strict=True):
            if live.fin:
                continue
            live.inflight -= n
            stale = live.stale > 0
            if stale:
                live.stale -= n
            if not sampled:
                continue
            seq = live.seq
            had_ph = live.ph > 0
            seq.append_tokens(1)
            if not stale and had_ph:
                live.ph -= 1
            row = live.row  # (a fanned-out request's first token is its first sample's)
            if seq.num_tokens == seq.num_prompt_tokens + 1 and log.first_token[row] != log.first_token[row]:
                log.first_token[row] = now
                log.first_token_step[row] = self.step
            running = live.order >= 0
            if running and not stale and had_ph:
                self.m.cache_blocks(seq, seq.num_computed_tokens - live.inflight)
            if seq.num_tokens >= live.target:
                if not running:
                    self.waiting.remove(live)
                self._retire(live, FINISHED, "", now)
                stopped = True
        if stopped:
            self.running = [x for x in self.running if x.order >= 0]
        self.internal_fragmentation = self.m.internal_fragmentation([x.seq for x in self.running])

    def _retire(self, live: Live, status: int, reason: str, now: float) -> None:
        live.fin = True
        self._finished = True
        super()._retire(live, status, reason, now)

    def complete(self, b: Batch, now: float) -> None:
        raise TypeError("AsyncScheduler: a batch's output is applied by apply(), not complete()")

