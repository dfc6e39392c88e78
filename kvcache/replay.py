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

With a host tier (`Offload`, vLLM 0.33's native KV offloading) transfers are
instantaneous: at every admission the GPU hit continues into the tier over whole
chunks as `sim.engine.offload.Offloader.lookup` decides (up to every known token;
a full hit recomputes the last token), and those chunks are loaded and cached at
once; the computed context's full chunks not hit or loaded are stored at once
(prompt chunks only, unless `prompt_only` is off), and a finishing request offers
the rest (then its accesses are committed to the tier's policy).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kvsim.kvcache.manager import KVCacheManager
from kvsim.kvcache.offload.tier import HostTier
from kvsim.kvcache.sequence import Sequence

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


@dataclass(slots=True)
class OffloadRecord(ReplayRecord):
    """A request's record in a replay with a host tier: also the tokens loaded from it."""

    offload_hit_tokens: int = 0


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
    host_chunks: int | None = None  # None: no host tier; the offload fields stay 0
    offload_hit_tokens: int = 0
    stored_blocks: int = 0
    loaded_blocks: int = 0
    offload_evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def total_hit_rate(self) -> float:
        """GPU and host-tier hits at first admissions over prompt tokens."""
        hits = self.hit_tokens + self.offload_hit_tokens
        return hits / self.prompt_tokens if self.prompt_tokens else 0.0

    def add(self, rec: ReplayRecord) -> None:
        self.requests += 1
        self.prompt_tokens += rec.prompt_tokens
        self.hit_tokens += rec.hit_tokens
        self.output_tokens += rec.output_tokens
        self.rejected += rec.status == REJECTED
        self.truncated += rec.status == TRUNCATED
        self.preemptions += rec.preemptions

    def as_dict(self) -> dict:
        """The totals; the offloading ones only with a host tier."""
        d = {
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
        if self.host_chunks is not None:
            d.update(offload_hit_tokens=self.offload_hit_tokens, total_hit_rate=self.total_hit_rate,
                     host_chunks=self.host_chunks, stored_blocks=self.stored_blocks,
                     loaded_blocks=self.loaded_blocks, offload_evictions=self.offload_evictions)
        return d


@dataclass(frozen=True)
class Offload:
    """KV offloading for a replay: the host tier, GPU blocks a chunk, and whether only prompt
    chunks are stored (vLLM's `blocks_per_chunk`, `offload_prompt_only`)."""

    tier: HostTier
    blocks_per_chunk: int = 1
    prompt_only: bool = True


class _Live:
    """A request in flight: its sequence, record and tokens still to sample."""

    __slots__ = ("seq", "rec", "target", "stored")

    def __init__(self, req: Request, uid: int, record: type[ReplayRecord] = ReplayRecord):
        self.seq = Sequence(req.id, req.prompt, uid=uid, output=req.output)
        self.rec = record(req.id, req.prompt_len)
        self.target = max(req.output_len, 1)
        self.stored = 0  # with a host tier: chunks before this one were offered to it


class _Connector:
    """The host tier driven with instantaneous transfers, as `sim.engine.offload.Offloader`
    decides lookups, loads and stores (a chunk's key: the hash of its last block)."""

    def __init__(self, offload: Offload, block_size: int):
        if offload.blocks_per_chunk < 1:
            raise ValueError(f"blocks_per_chunk must be at least 1, got {offload.blocks_per_chunk}")
        self.tier = offload.tier
        self.bs, self.bpc = block_size, offload.blocks_per_chunk
        self.tpc = block_size * offload.blocks_per_chunk  # tokens a chunk
        self.prompt_only = offload.prompt_only
        self.stored_blocks = self.loaded_blocks = 0

    def _keys(self, seq: Sequence) -> list[int]:
        """Keys of the chunks full of known tokens."""
        n = seq.num_tokens // self.tpc
        return seq.hashes_upto(n * self.tpc, self.bs)[self.bpc - 1:n * self.bpc:self.bpc]

    def _positions(self, first: int, end: int) -> list[int]:
        return [(i + 1) * self.tpc for i in range(first, end)]

    def lookup(self, live: _Live, local: int) -> int:
        """Tokens past the `local` (block-aligned) GPU hit that whole chunks in the tier cover."""
        live.stored = 0  # restarting at token 0: every chunk is offered again
        keys, tpc = self._keys(live.seq), self.tpc
        if len(keys) * tpc - local < tpc:
            return 0
        end = local // tpc  # the chunk holding the first token past the GPU hit
        end += self.tier.lookup_chunks(live.seq.seq_id, keys[end:], end, tpc)[0]
        n = end * tpc - local
        return n if n >= tpc else 0

    def load(self, live: _Live, local: int, n: int, new_blocks: int) -> None:
        """Load the chunks under tokens [local, local + n): pinned and released at once."""
        first, end = local // self.bs // self.bpc, (local + n) // self.tpc
        keys = self._keys(live.seq)[first:end]
        sid = live.seq.seq_id
        self.tier.prepare_load(sid, keys, self._positions(first, end))
        self.tier.complete_load(keys)
        live.stored = end  # the hit and loaded chunks are not offered again
        self.loaded_blocks += new_blocks

    def offer(self, live: _Live, upto: int) -> None:
        """Store `live`'s chunks not yet offered up to token `upto` (prompt chunks only, by default);
        when the tier cannot make room nothing is stored and they are offered again later."""
        seq = live.seq
        n = min(upto, seq.num_tokens)
        if self.prompt_only:
            n = min(n, seq.num_prompt_tokens)
        start, end = live.stored, n // self.tpc
        if end <= start:
            return
        keys = self._keys(seq)[start:end]
        out = self.tier.prepare_store(seq.seq_id, keys, self._positions(start, end))
        if out is None:
            return
        live.stored = end
        if out.keys:
            self.tier.complete_store(out.keys)
            self.stored_blocks += len(out.keys) * self.bpc

    def finished(self, live: _Live) -> None:
        """The request is done: offer its remaining computed chunks, commit its accesses."""
        seq = live.seq
        self.offer(live, max(seq.num_prompt_tokens, seq.num_tokens - 1))
        self.tier.request_finished(seq.seq_id)


def _allocate(m: KVCacheManager, live: _Live, conn: _Connector | None) -> tuple[int, int] | None:
    """Blocks for `live`'s whole context at an admission: its GPU hit, the tokens loaded from the
    host tier (cached like computed ones), the rest computed. (GPU hit, tier hit) tokens, or None
    (nothing changes) when they do not fit."""
    seq = live.seq
    if getattr(m, "has_mamba", False):  # each admission a step: a Mamba hit hashed before it may be taken
        m.new_step_starts()
    blocks, hit = m.get_computed_blocks(seq)
    ext = conn.lookup(live, hit) if conn is not None else 0
    if not ext:
        if m.allocate_slots(seq, seq.num_tokens - hit, hit, blocks) is None:
            return None
    else:
        new = m.allocate_for_load(seq, hit, blocks, ext)
        if new is None:
            return None
        conn.load(live, hit, ext, len(new))
        m.cache_blocks(seq, hit + ext)
        seq.num_computed_tokens = min(hit + ext, seq.num_tokens - 1)  # a full hit recomputes the last token
        m.allocate_slots(seq, seq.num_tokens - seq.num_computed_tokens)  # fits: the whole context did
    if conn is not None:
        conn.offer(live, seq.num_tokens)
    return hit, ext


def replay(
    requests: Iterable[Request],
    manager: KVCacheManager,
    max_running: int = 1,
    on_record: Callable[[ReplayRecord], None] | None = None,
    offload: Offload | None = None,
) -> ReplayResult:
    """Replay `requests` (in arrival order) through `manager`, over `offload`'s host tier if
    given; returns totals."""
    if max_running < 1:
        raise ValueError(f"max_running must be >= 1, got {max_running}")
    result = ReplayResult()
    conn = _Connector(offload, manager.block_size) if offload is not None else None

    def done(rec: ReplayRecord) -> None:
        result.add(rec)
        if conn is not None:
            result.offload_hit_tokens += rec.offload_hit_tokens
        if on_record is not None:
            on_record(rec)

    if max_running == 1:
        _sequential(requests, manager, done, conn)
    else:
        _concurrent(requests, manager, max_running, done, conn)
    result.evicted_blocks = manager.pool.num_evictions
    if conn is not None:
        result.host_chunks = conn.tier.num_chunks
        result.stored_blocks, result.loaded_blocks = conn.stored_blocks, conn.loaded_blocks
        result.offload_evictions = conn.tier.num_evictions
    return result


def _sequential(requests: Iterable[Request], m: KVCacheManager, done: Callable, conn: _Connector | None) -> None:
    record = ReplayRecord if conn is None else OffloadRecord
    for uid, req in enumerate(requests):
        live = _Live(req, uid, record)
        seq, rec = live.seq, live.rec
        hits = _allocate(m, live, conn) if req.prompt_len else None  # an empty prompt: rejected, as vLLM does
        if hits is None:
            rec.status = REJECTED
            done(rec)
            continue
        rec.hit_tokens = hits[0]
        if conn is not None:
            rec.offload_hit_tokens = hits[1]
        seq.num_computed_tokens = seq.num_tokens
        seq.append_tokens(1)
        sampled = 1
        # NOTE: nothing else touches the pool between this request's decode
        # steps, so one allocation for all of them ends in the same state as
        # one per token; per-token only when it does not fit (truncation).
        n = live.target - 1
        if n > 0 and m.sliding_window is None and m.num_groups == 1:  # windows free blocks token by token
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
        if conn is not None:
            conn.finished(live)
        m.free(seq)
        done(rec)


def _concurrent(requests: Iterable[Request], m: KVCacheManager, k: int, done: Callable,
                conn: _Connector | None) -> None:
    # NOTE: requests are pulled from the stream only when the waiting line is
    # empty and one is wanted, so at most k running + the preempted + one head
    # are live at once; preempted requests return to the line's front.
    arrivals = enumerate(requests)
    waiting: deque[_Live] = deque()
    record = ReplayRecord if conn is None else OffloadRecord

    def head() -> bool:
        """Whether a request is waiting, pulling the next arrival if none is."""
        if not waiting:
            pulled = next(arrivals, None)
            if pulled is None:
                return False
            waiting.append(_Live(pulled[1], pulled[0], record))
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
            hits = _allocate(m, live, conn) if live.rec.prompt_tokens else None  # an empty prompt: rejected
            if hits is None:
                if (running or admitted) and live.rec.prompt_tokens:
                    break
                waiting.popleft()
                live.rec.status = REJECTED
                live.rec.hit_tokens = 0
                done(live.rec)
                continue
            waiting.popleft()
            if live.rec.output_tokens == 0 and live.rec.preemptions == 0:
                live.rec.hit_tokens = hits[0]
                if conn is not None:
                    live.rec.offload_hit_tokens = hits[1]
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
                if conn is not None:
                    conn.finished(live)
                m.free(live.seq)
                done(live.rec)
        # 5. no progress: truncate a lone request, else preempt the youngest
        if not decoded and not admitted and running:
            if len(running) == 1:
                live = running.pop()
                live.rec.status = TRUNCATED
                if conn is not None:
                    conn.finished(live)
                m.free(live.seq)
                done(live.rec)
            else:
                live = running.pop()
                m.free(live.seq)
                live.seq.num_computed_tokens = 0
                live.rec.preemptions += 1
                waiting.appendleft(live)
