"""The one request model every part of kvsim uses."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

TokenIds = np.ndarray  # 1-D int32


@dataclass(slots=True, eq=False)
class Request:
    """One serving request: when it arrives, what it asks, how much it answers.

    `prompt` may be given lazily as a zero-argument callable (trace loaders do
    this so a long trace stays small in memory); `prompt_len` is always known.
    `output` holds the answer's token ids when they are known (a multi-turn
    session whose next prompt contains this answer); otherwise the simulator
    decodes unique tokens that never equal a prompt token.
    Prompt token ids are always >= 0: the simulator gives the unique tokens
    it decodes negative ids, so they can never equal a prompt token.
    `think_time` is, for a session turn after the first, the user's pause in
    seconds between the previous turn's answer and this request; the
    simulator's closed loop uses it to place the arrival.
    """

    id: str
    arrival: float
    prompt_len: int
    output_len: int
    _prompt: TokenIds | Callable[[], TokenIds] | None = field(default=None, repr=False)
    output: TokenIds | None = field(default=None, repr=False)
    session: str | None = None
    n: int = 1
    priority: int = 0
    think_time: float | None = None
    # block keys of the prompt, hashed by the first of the copies `sharing_prompt` made (a P/D cluster's
    # prefill and decode requests) and taken by the next (`WaitQueue.hash_ahead`):
    # (block size, full blocks, the tokens' buffer) -> (keys, chain state)
    keys_memo: dict[tuple[int, int, int], tuple[list[int], int]] | None = field(default=None, repr=False)

    @property
    def prompt(self) -> TokenIds:
        """Prompt token ids (int32), materialised on first access."""
        p = self._prompt
        if p is None:
            raise ValueError(f"request {self.id!r} has no prompt tokens")
        if callable(p):
            p = np.ascontiguousarray(p(), dtype=np.int32)
            if len(p) != self.prompt_len:
                raise ValueError(
                    f"request {self.id!r}: lazy prompt has {len(p)} tokens, expected {self.prompt_len}"
                )
            self._prompt = p
        return p

    def sharing_prompt(self, **changes: Any) -> Request:
        """A copy with `changes` that shares this request's prompt tokens: a lazy prompt is made once,
        here, not again by the copy (a P/D cluster's prefill request and its decode request), and its
        block keys are hashed once (`keys_memo`, keyed by the tokens' buffer: a copy whose prompt is a
        prefix of the same array, as the prefill side's is, finds the keys of its full blocks)."""
        if callable(self._prompt):
            self.prompt  # noqa: B018 - materialises the tokens both share
        if self.keys_memo is None:
            self.keys_memo = {}
        return replace(self, **changes)


def make_request(
    id: str,
    arrival: float,
    prompt: TokenIds | Iterable[int] | Callable[[], TokenIds],
    output_len: int,
    *,
    prompt_len: int | None = None,
    output: Iterable[int] | None = None,
    session: str | None = None,
    n: int = 1,
    priority: int = 0,
    think_time: float | None = None,
) -> Request:
    """Build a Request, normalising token arrays to int32."""
    if callable(prompt):
        if prompt_len is None:
            raise ValueError(f"request {id!r}: a lazy prompt needs prompt_len")
        p: TokenIds | Callable[[], TokenIds] = prompt
    else:
        p = np.ascontiguousarray(np.asarray(prompt), dtype=np.int32)
        prompt_len = len(p)
    out = None if output is None else np.ascontiguousarray(np.asarray(output), dtype=np.int32)
    return Request(
        id=id,
        arrival=float(arrival),
        prompt_len=int(prompt_len),
        output_len=int(output_len),
        _prompt=p,
        output=out,
        session=session,
        n=int(n),
        priority=int(priority),
        think_time=think_time,
    )


class Workload:
    """A re-iterable, streamed sequence of requests in arrival order.

    `source` is a zero-argument callable returning a fresh iterator, so a
    trace file is read again on each pass instead of being held in memory.
    Loaders opened with `skip_bad=True` set `skipped` (bad lines skipped in
    the latest pass) and `skipped_errors` (the first few messages).
    """

    def __init__(self, source: Callable[[], Iterator[Request]], name: str = "workload"):
        self._source = source
        self.name = name
        self.skipped = 0
        self.skipped_errors: list[str] = []
        self.spec: Any = None  # how another process reopens it (set by the Python API: kvsim.sim.api)

    def __iter__(self) -> Iterator[Request]:
        return self._source()

    @classmethod
    def from_list(cls, requests: list[Request], name: str = "workload") -> Workload:
        return cls(lambda: iter(requests), name)

    @classmethod
    def as_received(cls, received: Iterable[tuple[float, Request]], name: str) -> Workload:
        """Requests as one engine received them, `(time, request)` in the order they reached it:
        each arriving at its time with no think time (already placed), so replaying them alone
        at load 1 gives that engine's run again (a cluster's replica, `kvsim conform --cluster-run`)."""
        return cls.from_list([replace(r, arrival=t, think_time=None) for t, r in received], name)

    def iter_chunks(self, size: int) -> Iterator[list[Request]]:
        """One pass in lists of at most `size` requests (bounded memory, vectorisable batches)."""
        return iter_chunks(self, size)


def iter_chunks(requests: Iterable[Request], size: int) -> Iterator[list[Request]]:
    """Group a request stream into lists of at most `size`, keeping only one list in memory."""
    if size < 1:
        raise ValueError(f"chunk size must be >= 1, got {size}")
    chunk: list[Request] = []
    for r in requests:
        chunk.append(r)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
