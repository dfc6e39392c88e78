"""Cache replay: drive the block manager with a fixed loop and no time model.

Used to study a cache policy alone (`kvsim cache-replay`). Two modes:

- sequential (max_running = 1): one request at a time, in arrival order:
  look up, allocate the prompt, decode `output_len - 1` slots, free.
- concurrent (max_running = K > 1): discrete steps of decode-then-admit with
  recompute preemption of the youngest request when nothing can progress.

Both stream: a request is taken from `requests` only when it is about to be
admitted, so memory holds the running and preempted requests, not the trace.

A request's hit tokens are those of its first admission; the lookup of a
preempted request's readmission is not counted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kvcache.manager import KVCacheManager
from kvcache.sequence import Sequence

Request = Any  # anything with id, prompt, prompt_len, output, output_len (workloads.Request)

FINISHED, TRUNCATED, REJECTED = "finished", "truncated", "rejected"


@dataclass(slots=True)
class ReplayRecord:
    """What happened to one request."""

    id: str
    prompt_tokens: int
    hit_tokens: int = 0
    output_tokens: int = 0
    status: str = FINISHED
    preemptions: int = 0


@dataclass
class ReplayResult:
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    output_tokens: int = 0
    evicted_blocks: int = 0
    rejected: int = 0
    truncated: int = 0
    preemptions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def add(self, rec: ReplayRecord) -> None:
        self.requests += 1
        self.prompt_tokens += rec.prompt_tokens
        self.hit_tokens += rec.hit_tokens
        self.output_tokens += rec.output_tokens
        self.rejected += rec.status == REJECTED
        self.truncated += rec.status == TRUNCATED
        self.preemptions += rec.preemptions

    def as_dict(self) -> dict:
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "hit_tokens": self.hit_tokens,
            "hit_rate": self.hit_rate,
            "output_tokens": self.output_tokens,
            "evicted_blocks": self.evicted_blocks,
            "rejected": self.rejected,
            "truncated": self.truncated,
            "preemptions": self.preemptions,
        }


class _Live:
    """A request in flight: its sequence, record and tokens still to sample."""

    __slots__ = ("seq", "rec", "target")

    def __init__(self, req: Request, uid: int):
        self.seq = Sequence(req.id, req.prompt, uid=uid, output=req.output)
        self.rec = ReplayRecord(req.id, req.prompt_len)
        self.target = max(req.output_len, 1)


def replay(
    requests: Iterable[Request],
    manager: KVCacheManager,
    max_running: int = 1,
    on_record: Callable[[ReplayRecord], None] | None = None,
) -> ReplayResult:
    """Replay `requests` (in arrival order) through `manager`; returns totals."""
    if max_running < 1:
        raise ValueError(f"max_running must be >= 1, got {max_running}")
    result = ReplayResult()

    def done(rec: ReplayRecord) -> None:
        result.add(rec)
        if on_record is not None:
            on_record(rec)

    if max_running == 1:
        _sequential(requests, manager, done)
    else:
        _concurrent(requests, manager, max_running, done)
    result.evicted_blocks = manager.pool.num_evictions
    return result


def _sequential(requests: Iterable[Request], m: KVCacheManager, done: Callable) -> None:
    for uid, req in enumerate(requests):
        live = _Live(req, uid)
        seq, rec = live.seq, live.rec
        blocks, hit = m.get_computed_blocks(seq)
        if m.allocate_slots(seq, seq.num_tokens - hit, hit, blocks) is None:
            rec.status = REJECTED
            done(rec)
            continue
        rec.hit_tokens = hit
        seq.num_computed_tokens = seq.num_tokens
        seq.append_tokens(1)
        sampled = 1
        # NOTE: nothing else touches the pool between this request's decode
        # steps, so one allocation for all of them ends in the same state as
        # one per token; per-token only when it does not fit (truncation).
        n = live.target - 1
        if n > 0 and m.sliding_window is None:
            seq.append_tokens(n)
            if m.allocate_slots(seq, n) is not None:
                seq.num_computed_tokens += n
                sampled += n
            else:
                seq.num_tokens -= n
        while sampled < live.target:
            if m.allocate_slots(seq, 1) is None:
                rec.status = TRUNCATED
                break
            seq.num_computed_tokens += 1
            seq.append_tokens(1)
            sampled += 1
        rec.output_tokens = sampled
        m.free(seq)
        done(rec)


def _concurrent(requests: Iterable[Request], m: KVCacheManager, k: int, done: Callable) -> None:
    # NOTE: requests are pulled from the stream only when the waiting line is
    # empty and one is wanted, so at most k running + the preempted + one head
    # are live at once; preempted requests return to the line's front.
    arrivals = enumerate(requests)
    waiting: deque[_Live] = deque()

    def head() -> bool:
        """Whether a request is waiting, pulling the next arrival if none is."""
        if not waiting:
            pulled = next(arrivals, None)
            if pulled is None:
                return False
            waiting.append(_Live(pulled[1], pulled[0]))
        return True

    running: list[_Live] = []
    step = 0
    while running or head():
        m.ops.step = step
        step += 1
        # 1. decode
        decoded, stalled = [], False
        for live in running:
            if m.allocate_slots(live.seq, 1) is None:
                stalled = True
            else:
                decoded.append(live)
        # 2. admit
        admitted: list[_Live] = []
        while not stalled and len(running) + len(admitted) < k and head():
            live = waiting[0]
            seq = live.seq
            blocks, hit = m.get_computed_blocks(seq)
            if m.allocate_slots(seq, seq.num_tokens - hit, hit, blocks) is None:
                if running or admitted:
                    break
                waiting.popleft()
                live.rec.status = REJECTED
                live.rec.hit_tokens = 0
                done(live.rec)
                continue
            waiting.popleft()
            if live.rec.output_tokens == 0 and live.rec.preemptions == 0:
                live.rec.hit_tokens = hit
            admitted.append(live)
        # 3. compute: decodes add a token; admissions compute their context and sample one
        for live in decoded:
            live.seq.num_computed_tokens += 1
            live.seq.append_tokens(1)
            live.rec.output_tokens += 1
        for live in admitted:
            live.seq.num_computed_tokens = live.seq.num_tokens
            live.seq.append_tokens(1)
            live.rec.output_tokens += 1
        running.extend(admitted)
        # 4. finish, in scheduling order
        for live in decoded + admitted:
            if live.rec.output_tokens >= live.target:
                running.remove(live)
                m.free(live.seq)
                done(live.rec)
        # 5. no progress: truncate a lone request, else preempt the youngest
        if not decoded and not admitted and running:
            if len(running) == 1:
                live = running.pop()
                live.rec.status = TRUNCATED
                m.free(live.seq)
                done(live.rec)
            else:
                live = running.pop()
                m.free(live.seq)
                live.seq.num_computed_tokens = 0
                live.rec.preemptions += 1
                waiting.appendleft(live)
