"""How a scheduled batch's output reaches the scheduler: the output mode, sync or async.

vLLM 0.33 splits a step's bookkeeping in two: `Scheduler._update_after_schedule`, run as the batch is
chosen, and `Scheduler.update_from_output`, run when the model runner's output arrives
(vllm/v1/core/sched/scheduler.py); its `AsyncScheduler` (vllm/v1/core/sched/async_scheduler.py)
overrides the first to count an output placeholder for each token a batch will sample, so batch
k + 1 can be chosen while batch k runs. kvsim's scheduler holds one of these two objects:

- `SyncOutput`: nothing happens at schedule time; when the step ends, computed tokens advance, a
  sequence whose known tokens are all computed samples one (forking v0-style samples after the
  prefill), finished sequences are freed (`update`).
- `AsyncOutput`: computed tokens advance as the batch is chosen, and a batch that ends a request's
  known tokens adds a placeholder (`after_schedule`); its output arrives later (`update`): sampled
  tokens are appended, placeholders resolved, blocks cached up to computed - in-flight tokens,
  finished requests freed; stale output from before a preemption still appends and may finish a
  waiting request, which leaves WAITING (`update_from_output`, `_update_request_with_output`). The
  engine keeps two batches in flight (`sim.engine.loop.Engine._steps`, its batch queue two deep). Sync's
  quiet runs do not apply; a request decoding mid-block is counted, not visited, by lazy decodes of its
  own where the manager allows (`sim.engine.shortcuts.AsyncLazy`), steps of those alone, and steps whose
  RUNNING pass visits plain decodes, run in a loop of their own (`sim.engine.async_quiet`), and the
  blocked-head skip applies. One sequence per request (vLLM V1's front
  end fans n > 1 out), recompute preemption only, no lookahead slots. With a sliding window (one
  group's) or vLLM's hybrid groups the scheduler passes each running request's in-flight tokens to
  `allocate_slots`, so windows and Mamba states let blocks go on the processed tokens (vLLM 0.33
  `KVCacheManager.allocate_slots`), and the windows' admission cap counts two batches in flight.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvsim.sim.engine.config import ConfigError
from kvsim.sim.engine.metrics import FINISHED

if TYPE_CHECKING:
    from kvsim.sim.engine.batch import Batch
    from kvsim.sim.engine.scheduler import (
        Scheduler,  # the host (an annotation only: no import at run time)
    )
    from kvsim.workloads.request import Request


class SyncOutput:
    """A step's output is applied when the step ends (vLLM's `Scheduler`)."""

    overlaps = False  # one batch in flight: the step loop waits for its output before scheduling
    shortcuts = True  # lazy decodes and quiet runs may run (sim.engine.shortcuts)
    caches_known = False  # allocate_slots' own caching is all a scheduled chunk needs

    def __init__(self, sched: Scheduler):
        self.s = sched

    def check(self, req: Request) -> None:
        """Every request can be taken."""

    def after_schedule(self, b: Batch) -> None:
        """Nothing advances before the step ends."""

    def update(self, b: Batch, now: float) -> None:
        """Apply a step that ended at `now`: advance tokens, sample, fork, free the finished;
        then set the scheduler's `internal_fragmentation` over the running sequences."""
        s = self.s
        log, la, bs = s.log, s.lookahead, s.m.block_size
        finished = list(b.finishing)
        frag, alive = b.frag, len(b.decodes) - len(finished) + b.lazy
        track = s.prefill.cadence is not None
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
                    log.first_token_step[row] = s.step
                    if live.req.n > 1 and t < live.target:
                        seqs = s.fork_samples(live)
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
                pos = {id(x): k for k, x in enumerate(s.running)}
                finished.sort(key=lambda x: pos[id(x)])
            s.finish(finished, now)
        if alive != len(s.running):  # some running sequences were not scheduled
            s.materialize()
            frag = sum(s.fragmentation(x.seq) for x in s.running)
        s.internal_fragmentation = frag


class AsyncOutput:
    """A batch's output is applied after the next batch is chosen (vLLM's `AsyncScheduler`)."""

    overlaps = True  # two batches in flight: batch k+1 is scheduled while batch k runs
    shortcuts = False  # no sync lazy decodes or quiet runs (its own lazy decodes and the blocked head run)
    caches_known = True  # blocks are cached only up to the known tokens (`num_tokens_to_cache`)

    def __init__(self, sched: Scheduler):
        if sched.swap:
            raise ConfigError("async_scheduling needs preemption='recompute' (vLLM V1 has no swap)")
        if sched.lookahead:
            raise ConfigError("async_scheduling does not model lookahead slots (num_lookahead_tokens must be 0)")
        self.s = sched

    def check(self, req: Request) -> None:
        """A request the async output cannot take: one that would fork samples."""
        if req.n != 1 and self.s.fork:
            raise ConfigError(f"request {req.id!r}: n={req.n}; async scheduling does not fork samples "
                              "(parallel_sampling='fork')")

    def after_schedule(self, b: Batch) -> None:
        """vLLM `_update_after_schedule`: computed tokens advance now; a chunk that reaches the known
        tokens plus placeholders samples one more (a placeholder)."""
        fence = self.s.sched_seq
        for live, n in zip(b.lives, b.tokens, strict=True):
            seq = live.seq
            c = seq.num_computed_tokens + n
            seq.num_computed_tokens = c
            live.inflight += n
            live.last_seq = fence
            sampled = c >= seq.num_tokens + live.ph
            b.sampled.append(sampled)
            live.prefilling = not sampled  # vLLM is_prefill_chunk
            if sampled:
                live.ph += 1

    def update(self, b: Batch, now: float) -> None:
        """The batch's output arrives at `now` (vLLM `update_from_output`): sampled tokens are
        appended, placeholders resolved, blocks cached, and finished requests freed."""
        s = self.s
        log, m = s.log, s.m
        if s.defer_frees and b.lives:
            s.processed()
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
            seq.num_tokens += 1  # (`append_tokens(1)` inline: every running request, every step)
            if not stale and had_ph:
                live.ph -= 1
            row = live.row  # (a fanned-out request's first token is its first sample's)
            if seq.num_tokens == seq.num_prompt_tokens + 1 and log.first_token[row] != log.first_token[row]:
                log.first_token[row] = now
                log.first_token_step[row] = s.step
            running = live.order >= 0
            if running and not stale and had_ph:
                m.cache_blocks(seq, seq.num_computed_tokens - live.inflight)
            if seq.num_tokens >= live.target:
                if not running:
                    s.waiting.remove(live)
                s.retire(live, FINISHED, "", now)
                stopped = True
        if stopped:
            s.drop_retired()
        lazy = s.fast.lazy if s.fast.async_decodes else None
        if lazy is not None and lazy.n:  # (lazy decodes lag: `AsyncLazy.applied_slots`)
            # (the running sequences not lazy are the shortcuts' visiting list, `Shortcuts.active`)
            s.internal_fragmentation = lazy.applied_slots(b.k) if lazy.n == len(s.running) else \
                m.internal_fragmentation([x.seq for x in s.fast.active]) + lazy.applied_slots(b.k)
        else:
            s.internal_fragmentation = m.internal_fragmentation([x.seq for x in s.running])
