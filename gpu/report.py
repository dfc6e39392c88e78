"""The replay report: ops executed, tokens verified, mismatches, measured against predicted time."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvsim.workloads.files import read_json

KINDS = ("write", "copy", "swap_out", "swap_in", "move", "store", "load", "file_write", "file_read", "attention")
MAX_LISTED = 100  # mismatches listed whole in the JSON report


@dataclass
class StepTime:
    step: int
    measured_s: float
    predicted_s: float  # the simulated model's geometry


@dataclass
class ReplayReport:
    """Totals of one replay; `mismatches` must be 0 for a correct op stream."""

    run: str
    device: str
    dtype: str
    geometry: dict[str, int]
    kernels: str = "triton"  # gpu.backends: "triton" or "torch"
    attention_layers: int = 0  # layers whose decode attention is checked against dense attention
    attention_sample: int | None = None  # at most this many decodes a step compared (None: all)
    check: str = "full"  # gpu.checks: "full" reads each written sequence whole, "touched" what changed
    steps: int = 0
    steps_checked: int = 0
    ops: Counter = field(default_factory=Counter)  # by kind, as in the stream
    units: Counter = field(default_factory=Counter)  # blocks (block ops) or tokens (write, attention)
    launches: int = 0
    tokens_verified: int = 0
    sequence_checks: int = 0
    decode_checks: int = 0
    mismatches: int = 0
    errors: list[str] = field(default_factory=list)  # the first few mismatch messages
    found: list = field(default_factory=list)  # the first MAX_FOUND mismatches (gpu.verify.Mismatch), for attribution
    measured_s: dict[str, float] = field(default_factory=dict)
    predicted_s: dict[str, float] = field(default_factory=dict)
    scale: float = 1.0  # replay block bytes / simulated block bytes
    launch_predicted_s: dict[str, float] = field(default_factory=dict)  # the replay's launches, priced
    config: dict = field(default_factory=dict)  # the run's config.json: a saved report prices itself again
    model: str = ""
    gpu: str = ""
    step_times: list[StepTime] = field(default_factory=list)
    # per (step, kind): [step, kind, units, timed batches, measured seconds, kernel launches]; what
    # `gpu.accuracy` fits (reports written before launches were counted have five columns)
    step_kinds: list[list] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.mismatches == 0

    def as_dict(self) -> dict:
        return {
            "run": self.run, "device": self.device, "kernels": self.kernels, "dtype": self.dtype,
            "geometry": self.geometry, "attention_layers": self.attention_layers,
            "attention_sample": self.attention_sample, "check": self.check,
            "steps": self.steps, "steps_checked": self.steps_checked, "ops": dict(self.ops),
            "units": dict(self.units), "launches": self.launches, "tokens_verified": self.tokens_verified,
            "sequence_checks": self.sequence_checks, "decode_checks": self.decode_checks,
            "mismatches": self.mismatches, "errors": self.errors,
            "first_mismatches": [asdict(m) for m in self.found[:MAX_LISTED]], "measured_s": self.measured_s,
            "predicted_s": self.predicted_s, "launch_predicted_s": self.launch_predicted_s, "scale": self.scale,
            "model": self.model, "gpu": self.gpu,
            "step_times": [[t.step, t.measured_s, t.predicted_s] for t in self.step_times],
            "step_kinds": self.step_kinds, "config": self.config,
        }

    def format(self) -> str:
        g = self.geometry
        if self.attention_layers:
            sample = f", at most {self.attention_sample} a step" if self.attention_sample else ""
            attention = f"{self.decode_checks:,} decode-attention checks ({self.attention_layers} layers{sample})"
        else:
            attention = "decode attention not checked (--attention-layers N checks it)"
        lines = [
            f"gpu replay of {self.run} on {self.device} with {self.kernels} kernels ({self.dtype}; {g['layers']} layers "
            f"x {g['kv_heads']} KV heads x {g['head_dim']} dims, {g['heads']} query heads, block size {g['block_size']})",
            f"steps          {self.steps:,} ({self.steps_checked:,} checked, {self.check} reads), "
            f"{self.launches:,} kernel launches",
            "ops            " + ", ".join(f"{k} {n:,}" for k, n in sorted(self.ops.items())),
            f"verified       {self.tokens_verified:,} tokens in {self.sequence_checks:,} sequence checks, {attention}",
            f"mismatches     {self.mismatches:,}",
            "",
            f"time by kind   measured here; predicted by the cost model ({self.model} on {self.gpu}); that "
            f"scaled x{self.scale:.3g} to this replay's bytes, plus its launches priced (launch_s)",
            f"{'kind':<10} {'units':>10} {'measured':>12} {'predicted':>12} {'replay':>12}",
        ]
        for k in KINDS:
            if self.units.get(k) and (k != "attention" or self.measured_s.get(k)):
                p = self.predicted_s.get(k, 0.0)
                lines.append(f"{k:<10} {self.units[k]:>10,} {_t(self.measured_s.get(k, 0.0)):>12} "
                             f"{_t(p):>12} {_t(p * self.scale + self.launch_predicted_s.get(k, 0.0)):>12}")
        if self.step_times:
            meas = [t.measured_s for t in self.step_times]
            pred = [t.predicted_s for t in self.step_times]
            lines.append(f"per step       measured mean {_t(sum(meas) / len(meas))}, max {_t(max(meas))}; "
                         f"predicted mean {_t(sum(pred) / len(pred))}, max {_t(max(pred))}")
        lines += [f"error          {e}" for e in self.errors]
        return "\n".join(lines)


def _t(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.1f} us"


def load_report(spec: str) -> dict:
    """A report `gpu-replay --save` wrote (gzipped if it ends in .gz), with its run's config: the one
    it holds, or for a report written before reports held one, `REPORT,CONFIG` names the run's
    config.json. Raises ValueError naming the file for anything else."""
    path, _, config_path = spec.partition(",")
    report = read_json(Path(path))
    if isinstance(report, dict) and config_path:
        report["config"] = read_json(Path(config_path))
    if not isinstance(report, dict) or "step_kinds" not in report:
        raise ValueError(f"{path}: not a report `kvsim gpu-replay --save` wrote (no step_kinds)")
    if not report.get("config"):
        raise ValueError(f"{path}: holds no run config (written before reports held one): "
                         f"name it as {path},RUN/config.json")
    return report
