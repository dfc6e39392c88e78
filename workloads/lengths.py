"""Length distributions for prompts, messages and outputs: seeded integer samplers.

A spec string names one on the command line: `fixed:N`, `uniform:LO,HI`
(inclusive), `lognormal:MEAN,CV` or `empirical:FILE[:prompt|output]`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvsim.workloads.request import Workload
from kvsim.workloads.traces import load_workload


@dataclass(frozen=True)
class Fixed:
    """Always `value` tokens."""

    value: int

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        if self.value < 0:
            raise ValueError(f"length must be >= 0, got {self.value}")
        return np.full(n, self.value, dtype=np.int64)

    def mean(self) -> float:
        return float(self.value)


@dataclass(frozen=True)
class Uniform:
    """Integers uniform in [lo, hi], both inclusive."""

    lo: int
    hi: int

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        if not 0 <= self.lo <= self.hi:
            raise ValueError(f"uniform lengths need 0 <= lo <= hi, got {self.lo}, {self.hi}")
        return rng.integers(self.lo, self.hi + 1, size=n, dtype=np.int64)

    def mean(self) -> float:
        return (self.lo + self.hi) / 2


@dataclass(frozen=True)
class LogNormal:
    """Lognormal with the given mean and coefficient of variation, rounded, clipped to [lo, hi]."""

    mean_value: float
    cv: float = 1.0
    lo: int = 1
    hi: int | None = None

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        if not self.mean_value > 0 or self.cv < 0:
            raise ValueError(
                f"lognormal needs mean > 0 and cv >= 0, got {self.mean_value}, {self.cv}"
            )
        sigma2 = np.log1p(self.cv**2)
        mu = np.log(self.mean_value) - sigma2 / 2
        x = np.rint(rng.lognormal(mu, np.sqrt(sigma2), size=n)).astype(np.int64)
        return np.clip(x, self.lo, self.hi)

    def mean(self) -> float:
        return float(self.mean_value)


@dataclass(frozen=True)
class Empirical:
    """Resamples (with replacement) from observed lengths, e.g. a trace's."""

    values: np.ndarray = field(repr=False)

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        if len(self.values) == 0:
            raise ValueError("empirical lengths need at least one observed value")
        return rng.choice(np.asarray(self.values, dtype=np.int64), size=n, replace=True)

    def mean(self) -> float:
        return float(np.mean(self.values))

    @classmethod
    def from_workload(cls, workload: Workload, which: str = "prompt") -> Empirical:
        """Prompt or output lengths of every request in a workload (one streamed pass)."""
        if which not in ("prompt", "output"):
            raise ValueError(f"which must be 'prompt' or 'output', got {which!r}")
        attr = "prompt_len" if which == "prompt" else "output_len"
        return cls(np.fromiter((getattr(r, attr) for r in workload), dtype=np.int64))


Lengths = Fixed | Uniform | LogNormal | Empirical


def parse_lengths(spec: str) -> Lengths:
    """A length distribution from its spec string (see the module docstring)."""
    kind, _, args = spec.partition(":")
    try:
        if kind == "fixed":
            return Fixed(int(args))
        if kind == "uniform":
            lo, hi = (int(a) for a in args.split(","))
            return Uniform(lo, hi)
        if kind == "lognormal":
            parts = [float(a) for a in args.split(",")]
            return LogNormal(*parts) if len(parts) == 2 else LogNormal(parts[0])
        if kind == "empirical":
            path, _, which = (
                args.rpartition(":")
                if args.endswith((":prompt", ":output"))
                else (args, "", "prompt")
            )
            if not Path(path).exists():
                raise ValueError(f"no such file {path!r}")
            return Empirical.from_workload(load_workload(path), which)
    except (TypeError, ValueError) as e:
        raise ValueError(f"bad length spec {spec!r}: {e}") from None
    raise ValueError(
        f"bad length spec {spec!r}: expected fixed:N, uniform:LO,HI, lognormal:MEAN,CV "
        "or empirical:FILE[:prompt|output]"
    )
