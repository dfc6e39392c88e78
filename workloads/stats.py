"""Workload statistics, including the ideal prefix-cache hit rate.

Ideal hit rate: an infinite cache fed requests in arrival order. A full
prompt block hits if an earlier request already produced the same prefix up
to and including that block; a request's hits stop at its first miss. Known
output tokens (`Request.output`) are cached after their request, as the
engine caches decoded blocks, so a next turn can hit its previous answer.
Only full prompt blocks count; unlike the engine, a prompt that hits in full
does not give back its last block for recomputation.
Block-level rate = hit full blocks / full blocks; token-level = hit tokens /
prompt tokens (all of them, partial last blocks included).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

import numpy as np

from kvsim.workloads.request import Request, Workload, iter_chunks

_M1 = np.uint64(0x9E3779B97F4A7C15)
_M2 = np.uint64(0xBF58476D1CE4E5B9)
_M3 = np.uint64(0x94D049BB133111EB)
_Q = 0xD6E8FEB86659FD93  # odd, so invertible modulo 2**64
_QINV = pow(_Q, -1, 2**64)
CHUNK_REQUESTS = 512


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (wraps modulo 2**64)."""
    x = x ^ (x >> np.uint64(30))
    x *= _M2
    x ^= x >> np.uint64(27)
    x *= _M3
    x ^= x >> np.uint64(31)
    return x


class _Powers:
    """`base**j mod 2**64` for j = 0..n-1, grown on demand."""

    def __init__(self, base: int):
        self.base = base
        self.table = np.ones(1, dtype=np.uint64)

    def __call__(self, n: int) -> np.ndarray:
        if n > len(self.table):
            m = max(n, 2 * len(self.table))
            steps = np.full(m, self.base, dtype=np.uint64)
            steps[0] = 1
            self.table = np.cumprod(steps, dtype=np.uint64)
        return self.table[:n]


_QPOW, _QINVPOW = _Powers(_Q), _Powers(_QINV)


def block_keys(tokens: np.ndarray, block_size: int) -> np.ndarray:
    """One uint64 key per full block, chaining every earlier block (a prefix key).

    Stable across runs and processes (no salted hash()): each token is mixed
    with its offset in the block, summed into a block hash, and the blocks
    are chained as `H_j = H_{j-1} * Q + h_j` with cumsum, so it is vectorised.
    """
    nb = len(tokens) // block_size
    if nb == 0:
        return np.empty(0, dtype=np.uint64)
    t = np.asarray(tokens[: nb * block_size], dtype=np.int64).astype(np.uint64)
    t = t.reshape(nb, block_size)
    t += np.arange(1, block_size + 1, dtype=np.uint64) * _M1
    t *= _M2
    t ^= t >> np.uint64(29)
    t *= _M3
    h = _mix(t.sum(axis=1, dtype=np.uint64))
    chain = np.cumsum(h * _QINVPOW(nb), dtype=np.uint64) * _QPOW(nb)
    return _mix(chain + np.arange(nb, dtype=np.uint64) * _M1)


def _merge_sorted(seen: np.ndarray, new: np.ndarray, at: np.ndarray) -> np.ndarray:
    """Insert sorted `new` keys into sorted `seen` at their searchsorted positions `at`."""
    pos = at + np.arange(len(new))
    out = np.empty(len(seen) + len(new), dtype=seen.dtype)
    keep = np.ones(len(out), dtype=bool)
    keep[pos] = False
    out[pos] = new
    out[keep] = seen
    return out


def _group(keys: np.ndarray, owner: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sorted unique keys, each key's index into them, and the first (lowest) owner of each."""
    order = np.argsort(keys, kind="stable")
    sk = keys[order]
    first = np.empty(len(sk), dtype=bool)
    first[0] = True
    np.not_equal(sk[1:], sk[:-1], out=first[1:])
    inv = np.empty(len(sk), dtype=np.int64)
    inv[order] = np.cumsum(first) - 1
    return sk[first], inv, owner[order[first]]  # stable sort: owners ascend within a key


def _leading_hits(hit: np.ndarray, pos: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Per request (`counts` consecutive blocks each), how many blocks hit before the first miss."""
    out = np.zeros(len(counts), dtype=np.int64)
    has = counts > 0
    if has.any():
        miss_at = np.where(hit, np.iinfo(np.int64).max, pos)
        starts = (np.cumsum(counts) - counts)[has]
        out[has] = np.minimum(np.minimum.reduceat(miss_at, starts), counts[has])
    return out


@dataclass
class IdealPrefixCache:
    """Accumulates the ideal hit rate over a request stream, fed in chunks (see module doc)."""

    block_size: int
    full_blocks: int = 0
    hit_blocks: int = 0
    prompt_tokens: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block size must be >= 1, got {self.block_size}")
        self._seen = np.empty(0, dtype=np.uint64)  # sorted keys of every cached block

    @property
    def hit_tokens(self) -> int:
        return self.hit_blocks * self.block_size

    def add(self, requests: list[Request]) -> np.ndarray:
        """Process requests (in arrival order) and return each one's hit block count."""
        B = self.block_size
        keys = [
            block_keys(r.prompt if r.output is None else np.concatenate([r.prompt, r.output]), B)
            for r in requests
        ]
        queries = np.array([r.prompt_len // B for r in requests], dtype=np.int64)
        self.prompt_tokens += sum(r.prompt_len for r in requests)
        self.full_blocks += int(queries.sum())
        counts = np.array([len(k) for k in keys], dtype=np.int64)
        if not counts.sum():
            return np.zeros(len(requests), dtype=np.int64)
        allk = np.concatenate(keys)
        owner = np.repeat(np.arange(len(requests)), counts)
        pos = np.arange(len(allk)) - np.repeat(np.cumsum(counts) - counts, counts)
        # A key hits if cached before this chunk or produced by an earlier request in it.
        uniq, inv, first_owner = _group(allk, owner)
        seen = self._seen
        at = np.searchsorted(seen, uniq)  # sorted needles: cache-friendly on a big `seen`
        cached = np.zeros(len(uniq), dtype=bool)
        if len(seen):
            cached = (at < len(seen)) & (seen[np.minimum(at, len(seen) - 1)] == uniq)
        hit = cached[inv] | (first_owner[inv] < owner)
        is_query = pos < np.repeat(queries, counts)
        hits = _leading_hits(hit[is_query], pos[is_query], queries)
        self.hit_blocks += int(hits.sum())
        self._seen = _merge_sorted(seen, uniq[~cached], at[~cached])
        return hits

    def block_rate(self) -> float:
        return self.hit_blocks / self.full_blocks if self.full_blocks else 0.0

    def token_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def ideal_hit_rate(requests: Iterable[Request], block_size: int = 16) -> IdealPrefixCache:
    """Run the ideal infinite prefix cache over a stream; read the result's rates and counts."""
    cache = IdealPrefixCache(block_size)
    for chunk in iter_chunks(requests, CHUNK_REQUESTS):
        cache.add(chunk)
    return cache


@dataclass(frozen=True)
class Summary:
    """p50 / p90 / p99 / mean of a length distribution (None when empty)."""

    p50: float | None
    p90: float | None
    p99: float | None
    mean: float | None

    @classmethod
    def of(cls, values: np.ndarray) -> Summary:
        if len(values) == 0:
            return cls(None, None, None, None)
        p = np.percentile(values, [50, 90, 99])
        return cls(float(p[0]), float(p[1]), float(p[2]), float(values.mean()))


@dataclass(frozen=True)
class WorkloadStats:
    """What `kvsim workload stats` reports, as plain fields (JSON-ready via to_dict)."""

    name: str
    requests: int
    sessions: int
    time_span: float
    mean_rate: float
    prompt_tokens: int
    output_tokens: int
    prompt_len: Summary
    output_len: Summary
    block_size: int
    full_blocks: int
    hit_blocks: int
    hit_tokens: int
    ideal_block_hit_rate: float
    ideal_token_hit_rate: float
    skipped: int
    empty_prompts: int = 0  # requests with no prompt token: vLLM 0.33 rejects them, and so does `kvsim run`

    def to_dict(self) -> dict:
        return asdict(self)


def describe(workload: Workload, block_size: int = 16) -> WorkloadStats:
    """One streamed pass computing counts, length percentiles and the ideal hit rate.

    Mean rate is (requests - 1) / time span: arrivals per second between the
    first and the last request.
    """
    cache = IdealPrefixCache(block_size)
    prompt_lens: list[np.ndarray] = []
    output_lens: list[np.ndarray] = []
    sessions: set[str] = set()
    first = last = 0.0
    n = 0
    for chunk in workload.iter_chunks(CHUNK_REQUESTS):
        if n == 0:
            first = chunk[0].arrival
        last = chunk[-1].arrival
        n += len(chunk)
        prompt_lens.append(np.array([r.prompt_len for r in chunk], dtype=np.int64))
        output_lens.append(np.array([r.output_len for r in chunk], dtype=np.int64))
        sessions.update(r.session for r in chunk if r.session is not None)
        cache.add(chunk)
    pl = np.concatenate(prompt_lens) if prompt_lens else np.empty(0, np.int64)
    ol = np.concatenate(output_lens) if output_lens else np.empty(0, np.int64)
    span = last - first
    return WorkloadStats(
        name=workload.name,
        requests=n,
        sessions=len(sessions),
        time_span=span,
        mean_rate=(n - 1) / span if span > 0 else 0.0,
        prompt_tokens=int(pl.sum()),
        output_tokens=int(ol.sum()),
        prompt_len=Summary.of(pl),
        output_len=Summary.of(ol),
        block_size=block_size,
        full_blocks=cache.full_blocks,
        hit_blocks=cache.hit_blocks,
        hit_tokens=cache.hit_tokens,
        ideal_block_hit_rate=cache.block_rate(),
        ideal_token_hit_rate=cache.token_rate(),
        skipped=workload.skipped,
        empty_prompts=int((pl == 0).sum()),
    )


def format_stats(s: WorkloadStats) -> str:
    """A short human-readable report of WorkloadStats."""

    def row(label: str, m: Summary) -> str:
        cells = [
            f"{v:>10,.1f}" if v is not None else f"{'-':>10}" for v in (m.p50, m.p90, m.p99, m.mean)
        ]
        return f"  {label:<12}" + "".join(cells)

    lines = [
        f"workload       {s.name}",
        f"requests       {s.requests:,}" + (f" in {s.sessions:,} sessions" if s.sessions else ""),
        f"time span      {s.time_span:,.1f} s",
        f"mean rate      {s.mean_rate:,.3f} req/s",
        f"prompt tokens  {s.prompt_tokens:,}",
        f"output tokens  {s.output_tokens:,}",
        f"  {'length':<12}" + "".join(f"{h:>10}" for h in ("p50", "p90", "p99", "mean")),
        row("prompt", s.prompt_len),
        row("output", s.output_len),
        f"ideal prefix-cache hit rate at block size {s.block_size}:",
        f"  blocks       {s.ideal_block_hit_rate:.2%} ({s.hit_blocks:,} / {s.full_blocks:,} full blocks)",
        f"  tokens       {s.ideal_token_hit_rate:.2%} ({s.hit_tokens:,} / {s.prompt_tokens:,} prompt tokens)",
    ]
    if s.empty_prompts:
        lines.append(f"empty prompts  {s.empty_prompts:,}: vLLM rejects a request with no prompt token, and so "
                     "do kvsim run and cache-replay")
    return "\n".join(lines)
