"""The rate a configuration sustains under an SLO, and what it costs (`kvsim capacity`).

Goodput as DistServe defines it (Zhong et al., OSDI 2024, section 2): the highest request rate
at which at least `attainment` of the requests meet both the TTFT and the TPOT targets. A
request that is rejected or never finishes misses them. The workload's arrivals are rescaled
(`SimConfig.load`: a request arriving at t arrives at t / load), so the rate is the workload's
offered rate times the load; closed-loop session turns still wait their think time.

The cluster's question (`replicas_for_rate`): at the workload's rate, the fewest replicas behind a
router that meet the same targets; it assumes attainment does not fall as replicas are added,
simulates the most replicas allowed first, then bisects 1..N (`workers` counts a round).

The rate search assumes attainment falls as the load rises. It brackets the answer by doubling or
halving the load from 1, then narrows the bracket [meets, misses] by evaluating `workers` loads
per round, evenly spaced in log scale inside it, in parallel (a bisection when workers is 1),
until the bracket is within `tolerance` (relative). Every evaluated load is kept, in order, so
the convergence can be shown and checked.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvsim.sim.engine.config import ConfigError, SimConfig

MAX_DOUBLINGS = 12  # loads from 1/4096 to 4096 times the workload's own rate
DEFAULT_TOLERANCE = 0.02


@dataclass
class Probe:
    """One simulated load: its arrival rate and the share of requests that met both targets."""

    load: float
    rate_rps: float
    attainment: float
    meets: bool
    summary: dict[str, Any] = field(repr=False, default_factory=dict)


@dataclass
class Capacity:
    """The answer: the highest load that met the targets (`best`), the lowest that missed
    (`above`; None if even the largest load tried met them), every probe in order, and the cost."""

    slo_ttft: float
    slo_tpot: float
    attainment: float
    gpus: int
    probes: list[Probe]
    best: Probe | None
    above: Probe | None
    gpu_hourly_cost: float | None = None

    @property
    def rate_rps(self) -> float:
        return self.best.rate_rps if self.best is not None else 0.0

    @property
    def rate_per_gpu(self) -> float:
        return self.rate_rps / self.gpus

    @property
    def cost_per_million_output_tokens(self) -> float | None:
        """Dollars per million output tokens at `best`'s rate (the GPUs' hourly cost over the
        output tokens they produce an hour); None without a cost or an answer."""
        if self.gpu_hourly_cost is None or self.best is None:
            return None
        per_s = self.best.summary.get("output_tokens_per_s", 0.0)
        return self.gpu_hourly_cost * self.gpus / 3600.0 / per_s * 1e6 if per_s else None

    def as_dict(self) -> dict[str, Any]:
        """The JSON of `kvsim capacity --json`."""
        best, above = self.best, self.above
        return {
            "rate_rps": self.rate_rps,
            "rate_per_gpu": self.rate_per_gpu,
            "attainment": best.attainment if best is not None else 0.0,
            "target_attainment": self.attainment,
            "slo_ttft": self.slo_ttft,
            "slo_tpot": self.slo_tpot,
            "gpus": self.gpus,
            "load": best.load if best is not None else 0.0,
            "rate_above_rps": above.rate_rps if above is not None else None,
            "attainment_above": above.attainment if above is not None else None,
            "output_tokens_per_s": best.summary.get("output_tokens_per_s") if best is not None else None,
            "gpu_hourly_cost": self.gpu_hourly_cost,
            "cost_per_million_output_tokens": self.cost_per_million_output_tokens,
            "probes": [{"load": p.load, "rate_rps": p.rate_rps, "attainment": p.attainment, "meets": p.meets}
                       for p in self.probes],
        }


def check_targets(slo_ttft: float, slo_tpot: float, attainment: float) -> None:
    """Raise ConfigError for targets no search can use."""
    for name, v in (("slo_ttft", slo_ttft), ("slo_tpot", slo_tpot)):
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
            raise ConfigError(f"{name} must be a positive number of seconds, got {v!r}")
    if isinstance(attainment, bool) or not isinstance(attainment, int | float) or not 0.0 < attainment <= 1.0:
        raise ConfigError(f"attainment must be in (0, 1], got {attainment!r}")


def search(
    evaluate: Callable[[list[float]], list[dict[str, Any]]],
    base_rate: float,
    *,
    attainment: float,
    tolerance: float = DEFAULT_TOLERANCE,
    workers: int = 1,
    on_probe: Callable[[Probe, float | None, float | None], None] | None = None,
) -> tuple[list[Probe], Probe | None, Probe | None]:
    """Find the highest load that meets `attainment`: `evaluate(loads)` simulates each load and
    returns its summaries (`slo_attainment`); `base_rate` is the workload's own rate (load 1).
    Returns every probe in order, the highest load that met the target and the lowest above it
    that missed. `on_probe(probe, lo, hi)` hears each probe with the bracket's loads after it."""
    probes: list[Probe] = []
    lo: Probe | None = None  # highest load that met the target
    hi: Probe | None = None  # lowest load that missed it

    def run(loads: list[float]) -> None:
        nonlocal lo, hi
        for load, s in zip(loads, evaluate(loads), strict=True):
            got = float(s["slo_attainment"])
            p = Probe(load, base_rate * load, got, got >= attainment, s)
            probes.append(p)
            if p.meets and (lo is None or load > lo.load):
                lo = p
            if not p.meets and (hi is None or load < hi.load):
                hi = p
            if on_probe is not None:
                on_probe(p, lo.load if lo else None, hi.load if hi else None)

    run([1.0])
    for _ in range(MAX_DOUBLINGS):  # bracket: halve down until a load meets, or double up until one misses
        if lo is not None and hi is not None:
            break
        if lo is None:
            run([hi.load / 2 ** (1 + k) for k in range(workers)])
        else:
            run([lo.load * 2 ** (1 + k) for k in range(workers)])
    if lo is not None and hi is not None and hi.load < lo.load:  # not monotone: a miss below a meet
        hi = min((p for p in probes if not p.meets and p.load > lo.load), key=lambda p: p.load, default=None)
    while lo is not None and hi is not None and hi.load / lo.load > 1 + tolerance:
        a, b = math.log(lo.load), math.log(hi.load)
        run([math.exp(a + (b - a) * (k + 1) / (workers + 1)) for k in range(workers)])
        if hi.load < lo.load:
            hi = min((p for p in probes if not p.meets and p.load > lo.load), key=lambda p: p.load, default=None)
    return probes, lo, hi


def capacity(
    workload: Any,
    cfg: SimConfig,
    *,
    slo_ttft: float,
    slo_tpot: float,
    attainment: float = 0.9,
    workers: int = 1,
    tolerance: float = DEFAULT_TOLERANCE,
    gpu_hourly_cost: float | None = None,
    on_probe: Callable[[Probe, float | None, float | None], None] | None = None,
    point: Callable[[dict[str, Any], Any], dict[str, Any]] | None = None,
) -> Capacity:
    """The highest rate of `workload` (a `sim.studies.sweep.WorkloadSpec`) at which `cfg` meets
    the targets for `attainment` of the requests; see the module docstring. `point(params,
    workload)` simulates one load and returns a record with `slo_attainment` (default: one engine,
    `simulate_point`; a cluster's or a P/D cluster's from the caller, `kvsim.sim.api.sweep_point`,
    since studies does not import the cluster). The GPUs are every replica's (`SimConfig.num_gpus`)."""
    from kvsim.sim.studies.sweep import run_parallel, simulate_point
    from kvsim.workloads.stats import describe

    check_targets(slo_ttft, slo_tpot, attainment)
    if workers < 1:
        raise ConfigError(f"workers must be >= 1, got {workers}")
    if not 0 < tolerance < 1:
        raise ConfigError(f"tolerance must be in (0, 1), got {tolerance!r}")
    if gpu_hourly_cost is not None and not gpu_hourly_cost > 0:
        raise ConfigError(f"gpu_hourly_cost must be positive, got {gpu_hourly_cost!r}")
    stats = describe(workload.open(), cfg.block_size)
    if stats.requests < 2 or not stats.mean_rate > 0:
        raise ConfigError("capacity needs a workload of at least 2 requests spread over time (a rate)")
    base = cfg.replace(slo_ttft=slo_ttft, slo_tpot=slo_tpot).to_dict()

    def evaluate(loads: list[float]) -> list[dict[str, Any]]:
        items = [({**base, "load": base["load"] * load}, workload) for load in loads]
        return run_parallel(point or simulate_point, items, workers)

    probes, best, above = search(evaluate, stats.mean_rate * cfg.load, attainment=attainment,
                                 tolerance=tolerance, workers=workers, on_probe=on_probe)
    return Capacity(slo_ttft, slo_tpot, attainment, cfg.num_gpus(), probes, best, above, gpu_hourly_cost)


@dataclass
class ReplicaProbe:
    """One simulated cluster: its replicas and the share of requests that met both targets."""

    replicas: int
    attainment: float
    meets: bool
    section: dict[str, Any] = field(repr=False, default_factory=dict)


@dataclass
class Replicas:
    """The cluster's answer for one router: the fewest replicas that met the targets (`best`, None
    if even `max_replicas` missed), the most that missed below it (`below`), every probe in order."""

    router: str
    max_replicas: int
    probes: list[ReplicaProbe]
    best: ReplicaProbe | None
    below: ReplicaProbe | None

    def as_dict(self) -> dict[str, Any]:
        """One router's entry in `kvsim capacity --max-replicas --json`."""
        best, below = self.best, self.below
        return {"replicas": best.replicas if best else None, "attainment": best.attainment if best else None,
                "replicas_below": below.replicas if below else None,
                "attainment_below": below.attainment if below else None, "max_replicas": self.max_replicas,
                "probes": [{"replicas": p.replicas, "attainment": p.attainment, "meets": p.meets}
                           for p in self.probes]}


def fewest_replicas(
    evaluate: Callable[[list[int]], list[dict[str, Any]]],
    max_replicas: int,
    *,
    attainment: float,
    workers: int = 1,
    on_probe: Callable[[ReplicaProbe], None] | None = None,
) -> tuple[list[ReplicaProbe], ReplicaProbe | None, ReplicaProbe | None]:
    """The fewest replicas in 1..`max_replicas` meeting `attainment`: `evaluate(counts)` simulates
    each count and returns its cluster sections (`overall["slo_attainment"]`). `max_replicas` first;
    then the bracket (most that missed, fewest that met) narrows by `workers` counts evenly inside
    it a round (a bisection with one) until they are adjacent. Returns the probes, best and below."""
    probes: list[ReplicaProbe] = []

    def run(counts: list[int]) -> None:
        for n, section in zip(counts, evaluate(counts), strict=True):
            got = float(section["overall"]["slo_attainment"])
            probes.append(ReplicaProbe(n, got, got >= attainment, section))
            if on_probe is not None:
                on_probe(probes[-1])

    def bracket() -> tuple[int, ReplicaProbe | None]:
        best = min((p for p in probes if p.meets), key=lambda p: p.replicas)
        below = max((p for p in probes if not p.meets and p.replicas < best.replicas),
                    key=lambda p: p.replicas, default=None)
        return (below.replicas if below else 0), best

    run([max_replicas])
    if not probes[0].meets:
        return probes, None, probes[0]
    lo, best = bracket()
    while best.replicas - lo > 1:
        span = best.replicas - lo
        run(sorted({lo + max(1, min(span - 1, round(span * (k + 1) / (workers + 1)))) for k in range(workers)}))
        lo, best = bracket()
    below = next((p for p in probes if p.replicas == lo), None)
    return probes, best, below


def replicas_for_rate(
    workload: Any,
    cfg: SimConfig,
    point: Callable[[dict[str, Any], Any], dict[str, Any]],
    *,
    slo_ttft: float,
    slo_tpot: float,
    max_replicas: int,
    attainment: float = 0.9,
    workers: int = 1,
    on_probe: Callable[[ReplicaProbe], None] | None = None,
) -> Replicas:
    """The fewest replicas of `cfg`'s engine behind `cfg.router` that meet the targets for
    `attainment` of `workload`'s requests (a `sim.studies.sweep.WorkloadSpec`) at its rate times
    `cfg.load`; `point(params, workload)` simulates one cluster (`sim.cluster.run.cluster_point`)."""
    from kvsim.sim.studies.sweep import run_parallel

    check_targets(slo_ttft, slo_tpot, attainment)
    if isinstance(max_replicas, bool) or not isinstance(max_replicas, int) or max_replicas < 1:
        raise ConfigError(f"max_replicas must be an integer >= 1, got {max_replicas!r}")
    if workers < 1:
        raise ConfigError(f"workers must be >= 1, got {workers}")
    base = cfg.replace(slo_ttft=slo_ttft, slo_tpot=slo_tpot).to_dict()

    def evaluate(counts: list[int]) -> list[dict[str, Any]]:
        return run_parallel(point, [({**base, "replicas": n}, workload) for n in counts], workers)

    probes, best, below = fewest_replicas(evaluate, max_replicas, attainment=attainment, workers=workers,
                                          on_probe=on_probe)
    return Replicas(cfg.router, max_replicas, probes, best, below)
