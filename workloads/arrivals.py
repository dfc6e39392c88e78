"""Arrival processes: when requests (or sessions) arrive, as seeded arrays of seconds.

Every process starts at t = 0 (the first arrival) and draws from the numpy
Generator it is given, so the same seed gives the same times.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvsim.workloads.names import ARRIVALS


def _from_gaps(gaps: np.ndarray) -> np.ndarray:
    """Arrival times 0, g0, g0+g1, ... for n = len(gaps) arrivals (the last gap is unused)."""
    out = np.zeros(len(gaps), dtype=np.float64)
    np.cumsum(gaps[:-1], out=out[1:])
    return out


@dataclass(frozen=True)
class Poisson:
    """Exponential gaps at `rate` requests per second (CV 1)."""

    rate: float

    def times(self, n: int, rng: np.random.Generator) -> np.ndarray:
        _check_rate(self.rate)
        return _from_gaps(rng.exponential(1.0 / self.rate, size=n))


@dataclass(frozen=True)
class Gamma:
    """Gamma-distributed gaps with mean 1/rate and coefficient of variation `cv`.

    cv > 1 is burstier than Poisson, cv < 1 smoother, cv = 1 is Poisson and
    cv = 0 a constant rate. Shape = 1/cv**2, scale = cv**2/rate.
    """

    rate: float
    cv: float = 1.0

    def times(self, n: int, rng: np.random.Generator) -> np.ndarray:
        _check_rate(self.rate)
        if self.cv < 0:
            raise ValueError(f"cv must be >= 0, got {self.cv}")
        if self.cv == 0:
            return Constant(self.rate).times(n, rng)
        shape = 1.0 / self.cv**2
        return _from_gaps(rng.gamma(shape, 1.0 / (shape * self.rate), size=n))


@dataclass(frozen=True)
class Constant:
    """Evenly spaced arrivals, 1/rate seconds apart."""

    rate: float

    def times(self, n: int, rng: np.random.Generator) -> np.ndarray:
        _check_rate(self.rate)
        return np.arange(n, dtype=np.float64) / self.rate


@dataclass(frozen=True)
class Given:
    """Arrivals at given timestamps (seconds, non-decreasing); the first `n` are used."""

    timestamps: Sequence[float]

    def times(self, n: int, rng: np.random.Generator) -> np.ndarray:
        t = np.asarray(self.timestamps, dtype=np.float64)
        if len(t) < n:
            raise ValueError(f"{n} arrivals asked for, only {len(t)} timestamps given")
        t = t[:n]
        if np.any(np.diff(t) < 0) or (len(t) and t[0] < 0):
            raise ValueError("given timestamps must be non-negative and non-decreasing")
        return t


ArrivalProcess = Poisson | Gamma | Constant | Given


def make_arrivals(kind: str, rate: float, cv: float = 1.0) -> ArrivalProcess:
    """The arrival process named `kind` (poisson, gamma, constant) at `rate` per second."""
    if kind == "poisson":
        return Poisson(rate)
    if kind == "gamma":
        return Gamma(rate, cv)
    if kind == "constant":
        return Constant(rate)
    raise ValueError(f"unknown arrival process {kind!r}; expected one of {', '.join(ARRIVALS)}")


def _check_rate(rate: float) -> None:
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate}")
