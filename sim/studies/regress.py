"""Golden-curve regression: recompute a baseline's points and compare with tolerances.

A baseline folder holds `baseline.toml` (what to compute) and `expected.json`
(the points last accepted). `baseline.toml`:

    kind = "hit_rate_vs_capacity"        # or "fragmentation_over_time"
    workload = "workload.jsonl"          # relative to the folder; or a [generator] table
    format = "auto"                      # optional
    metrics = ["hit_rate", "block_hit_rate"]
    tolerance = 1e-9                     # absolute; or a table per metric (missing: 0)
    [params]                             # hit_rate_vs_capacity: a `kvsim curve`
    capacities = [64, 128]
    policies = ["lru", "s3fifo"]
    block_size = 16
    mode = "replay"

`fragmentation_over_time` runs the full simulator once per policy with
`[params.config]` (SimConfig fields) and samples the per-step `metrics`
(e.g. id_fragmentation, used_blocks) every `sample_every_s` simulated seconds.
A `[generator]` table holds `kvsim workload generate` options (kind,
num_requests, seed, prefix_len = "fixed:256", ...).
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvsim.sim.engine.config import ConfigError, SimConfig
from kvsim.sim.studies.curves import MODES, capacity_curve, check_points
from kvsim.sim.studies.sweep import WorkloadSpec, read_toml, write_json_atomic
from kvsim.workloads.files import read_json

REGRESS_VERSION = 1
KINDS = ("hit_rate_vs_capacity", "fragmentation_over_time")
TOP_KEYS = {
    "kind",
    "description",
    "workload",
    "format",
    "generator",
    "metrics",
    "tolerance",
    "params",
}
PARAM_KEYS = {
    "hit_rate_vs_capacity": {"capacities", "policies", "block_size", "mode"},
    "fragmentation_over_time": {"policies", "sample_every_s", "config"},
}
DEFAULT_METRICS = {
    "hit_rate_vs_capacity": ["hit_rate"],
    "fragmentation_over_time": ["id_fragmentation"],
}

Points = dict[str, dict[str, float]]  # point -> metric -> value


@dataclass
class Baseline:
    """A parsed `baseline.toml` and the folder it lives in."""

    folder: Path
    kind: str
    workload: WorkloadSpec
    metrics: list[str]
    tolerance: dict[str, float]
    params: dict[str, Any]
    description: str = ""

    @property
    def expected_path(self) -> Path:
        return self.folder / "expected.json"


@dataclass
class Row:
    """One compared (point, metric)."""

    point: str
    expected: float | None
    got: float | None
    tolerance: float

    @property
    def delta(self) -> float | None:
        if self.expected is None or self.got is None:
            return None
        return self.got - self.expected

    @property
    def ok(self) -> bool:
        d = self.delta
        return d is not None and abs(d) <= self.tolerance


@dataclass
class Comparison:
    """Every compared row of one baseline."""

    baseline: Baseline
    rows: list[Row] = field(default_factory=list)

    @property
    def failures(self) -> list[Row]:
        return [r for r in self.rows if not r.ok]


def _check_keys(d: dict[str, Any], allowed: set[str], source: str) -> None:
    for key in d:
        if key not in allowed:
            hint = difflib.get_close_matches(key, allowed, 1)
            also = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise ConfigError(
                f"{source}: unknown key {key!r}{also}; expected {', '.join(sorted(allowed))}"
            )


def load_baseline(folder: str | Path) -> Baseline:
    """Parse `folder/baseline.toml`; a bad file raises ConfigError naming it and the key."""
    folder = Path(folder)
    path = folder / "baseline.toml"
    data = read_toml(path)
    _check_keys(data, TOP_KEYS, str(path))
    kind = data.get("kind")
    if kind not in KINDS:
        raise ConfigError(f"{path}: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    params = data.get("params", {})
    _check_keys(params, PARAM_KEYS[kind], f"{path} [params]")
    if "workload" in data and "generator" in data:
        raise ConfigError(f"{path}: give either workload or [generator], not both")
    if "workload" in data:
        spec = WorkloadSpec(str(folder / data["workload"]), data.get("format", "auto"))
    else:
        spec = WorkloadSpec(generator=tuple(sorted(data.get("generator", {}).items())))
    metrics = data.get("metrics", DEFAULT_METRICS[kind])
    tol = data.get("tolerance", 0.0)
    tolerance = {m: tol for m in metrics} if not isinstance(tol, dict) else dict(tol)
    _check_keys(tolerance, set(metrics), f"{path} [tolerance]")
    for m, t in tolerance.items():
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ConfigError(f"{path}: tolerance of {m} must be a finite number >= 0, got {t!r}")
    tolerance = {m: float(t) for m, t in tolerance.items()}
    base = Baseline(
        folder, kind, spec, list(metrics), tolerance, params, data.get("description", "")
    )
    _check_params(base, path)
    return base


def _check_params(b: Baseline, path: Path) -> None:
    p = b.params
    for key in ("policies",) + (("capacities",) if b.kind == "hit_rate_vs_capacity" else ()):
        if not isinstance(p.get(key), list) or not p[key]:
            raise ConfigError(f"{path} [params]: {key} must be a non-empty list")
    if b.kind == "hit_rate_vs_capacity":
        if p.get("mode", "replay") not in MODES:
            raise ConfigError(
                f"{path} [params]: mode must be one of {', '.join(MODES)}, got {p['mode']!r}"
            )
        try:
            check_points(p["capacities"], p["policies"], p.get("block_size", 16), p.get("mode", "replay"))
        except ConfigError as e:
            raise ConfigError(f"{path} [params]: {e}") from None
    else:
        dt = p.get("sample_every_s")
        if not isinstance(dt, (int, float)) or dt <= 0:
            raise ConfigError(
                f"{path} [params]: sample_every_s must be a positive number, got {dt!r}"
            )
        SimConfig.from_dict(p.get("config", {}), source=f"{path} [params.config]").validate()


def compute(b: Baseline, workers: int = 1) -> Points:
    """The baseline's points, freshly computed."""
    if b.kind == "hit_rate_vs_capacity":
        p = b.params
        df = capacity_curve(
            b.workload,
            p["capacities"],
            p["policies"],
            p.get("block_size", 16),
            p.get("mode", "replay"),
            workers,
        )
        return {
            f"{r['policy']} capacity={r['capacity']}": {m: _num(r[m]) for m in b.metrics}
            for r in df.to_dict("records")
        }
    return _fragmentation_over_time(b)


def _fragmentation_over_time(b: Baseline) -> Points:
    import numpy as np

    from kvsim.sim.engine.run import simulate

    cfg = SimConfig.from_dict(b.params.get("config", {}), source="params.config")
    dt = float(b.params["sample_every_s"])
    points: Points = {}
    for policy in b.params["policies"]:
        steps = simulate(b.workload.open(), cfg.replace(eviction=policy)).steps
        times = steps["time"].to_numpy()
        end = float(times[-1] + steps["duration"].iloc[-1]) if len(times) else 0.0
        for k in range(int(end // dt) + 1):
            t = round(k * dt, 6)
            i = int(np.searchsorted(times, t, side="right")) - 1
            points[f"{policy} t={t:g}s"] = {
                m: (_num(steps[m].iloc[i]) if i >= 0 else 0) for m in b.metrics
            }
    return points


def _num(v: Any) -> float | int:
    v = v.item() if hasattr(v, "item") else v
    return v if isinstance(v, int) else float(v)


def load_expected(b: Baseline) -> Points:
    path = b.expected_path
    if not path.is_file():
        raise ConfigError(f"{path}: missing; create it with `kvsim regress {b.folder} --update`")
    try:
        data = read_json(path)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not isinstance(data, dict) or data.get("kvsim_regress") != REGRESS_VERSION or not isinstance(data.get("points"), dict):
        raise ConfigError(f"{path}: not a kvsim regress file (version {REGRESS_VERSION})")
    return data["points"]


def write_expected(b: Baseline, points: Points) -> None:
    write_json_atomic(
        b.expected_path,
        {"kvsim_regress": REGRESS_VERSION, "kind": b.kind, "points": points},
        sort_keys=False,
    )


def compare(b: Baseline, expected: Points, got: Points) -> Comparison:
    """Rows for every (point, metric) in either set; a missing or new one fails."""
    cmp = Comparison(b)
    for point in list(expected) + [p for p in got if p not in expected]:
        exp, new = expected.get(point, {}), got.get(point, {})
        for metric in list(exp) + [m for m in new if m not in exp]:
            tol = b.tolerance.get(metric, 0.0)
            cmp.rows.append(Row(f"{point} {metric}", exp.get(metric), new.get(metric), tol))
    return cmp


def format_diff(rows: list[Row]) -> str:
    """A text table: point, expected, got, delta, tolerance."""

    def fmt(v: float | None, absent: str) -> str:
        if v is None:
            return absent
        return str(v) if isinstance(v, int) else f"{v:.6g}"

    cells = [["point", "expected", "got", "delta", "tolerance"]]
    for r in rows:
        d = r.delta
        delta = "-" if d is None else ("nan" if math.isnan(d) else f"{d:+.3g}")
        cells.append(
            [r.point, fmt(r.expected, "(new)"), fmt(r.got, "missing"), delta, f"{r.tolerance:g}"]
        )
    widths = [max(len(row[i]) for row in cells) for i in range(5)]
    lines = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in cells
    ]
    return "\n".join(lines)


def baseline_folders(path: str | Path) -> list[Path]:
    """`path` itself if it holds baseline.toml, else its subfolders that do (sorted)."""
    p = Path(path)
    if (p / "baseline.toml").is_file():
        return [p]
    found = sorted(d for d in p.glob("*/") if (d / "baseline.toml").is_file()) if p.is_dir() else []
    if not found:
        raise ConfigError(f"{p}: no baseline.toml here or in its subfolders")
    return found
