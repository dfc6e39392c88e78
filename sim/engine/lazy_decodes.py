"""Running sequences whose decode tokens land mid-block: counted each step, not visited.

Such a decode needs no block, copy or cache entry, so nothing about the
sequence changes but its token counts until its block is nearly full. A lazy
sequence's `seq` lags: it holds the state at the step it went lazy (`since`),
and every later step adds one computed and one sampled token. The batch totals
over lazy sequences are linear in the step number k, so they are kept as sums.
"""

from __future__ import annotations

from typing import Protocol

from kvcache.sequence import Sequence


class Lazy(Protocol):
    """What this module needs of a running sequence (the scheduler's `Live`)."""

    seq: Sequence
    since: int  # the step it went lazy; -1: not lazy
    wake: int  # the first step it must be visited again


class LazyDecodes:
    """The lazy sequences' count, their batch totals, and when each must be visited again."""

    def __init__(self, block_size: int):
        self.bs = block_size
        self.n = 0
        self._ctx = 0  # sum of (computed + 1 - since)
        self._frag = 0  # sum of (bs - 2 - computed % bs + since)
        self._wakes: dict[int, list[Lazy]] = {}  # step -> sequences whose laziness ends there

    def add(self, live: Lazy, k: int, last: int) -> None:
        """`live` (computed tokens c, c % bs in [0, bs - 2]) decodes in place at step k and at
        the `last` steps after it; it is visited again at step k + last + 1."""
        c = live.seq.num_computed_tokens
        live.since, live.wake = k, k + last + 1
        self.n += 1
        self._ctx += c + 1 - k
        self._frag += self.bs - 2 - c % self.bs + k
        w = self._wakes.get(k + last + 1)
        if w is None:
            self._wakes[k + last + 1] = [live]
        else:
            w.append(live)

    def drop(self, live: Lazy, k: int) -> None:
        """Bring `live`'s `seq` up to date at the start of step k; it is no longer lazy."""
        seq, d = live.seq, k - live.since
        c = seq.num_computed_tokens
        self.n -= 1
        self._ctx -= c + 1 - live.since
        self._frag -= self.bs - 2 - c % self.bs + live.since
        seq.num_computed_tokens = c + d
        seq.num_tokens += d
        live.since = -1

    def due(self, k: int) -> list[Lazy]:
        """Drop and return the sequences to visit again from step k on."""
        woken = self._wakes.pop(k, None) if self._wakes else None
        if not woken:
            return []
        out = []
        for live in woken:
            if live.since >= 0 and live.wake == k:  # else dropped early (and maybe lazy again)
                self.drop(live, k)
                out.append(live)
        return out

    def drop_all(self, lives: list[Lazy], k: int) -> None:
        """Drop every lazy sequence among `lives` at the start of step k."""
        for live in lives:
            if live.since >= 0:
                self.drop(live, k)
        self._wakes.clear()

    def context_tokens(self, k: int) -> int:
        """Sum of the lazy sequences' lengths after step k's decode (before its sample)."""
        return self._ctx + self.n * k

    def empty_slots(self, k: int) -> int:
        """Allocated slots of their last blocks not holding a token, after step k."""
        return self._frag - self.n * k
