"""Gather one GPU's raw measurements (benchmarks/gpu_session.sh output) into results/<gpu>.json
and the tables of results/README.md's section for it.

    python benchmarks/gpu_results.py benchmarks/results/raw/h100-sxm [--calibration FILE]

Predictions are recomputed here from the raw files, uncalibrated and with the calibration
profile, so the accuracy figures can be re-derived on any machine.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

import numpy as np

from kvsim.gpu.accuracy import error_stats, step_accuracy
from kvsim.gpu.calibrate import gpu_of_name
from kvsim.gpu.predict import predictor
from kvsim.sim.engine.cost_model import load_calibration


def replay_accuracy(report: dict, config: dict, calibration: Path) -> dict:
    """Per op kind: units, measured and predicted seconds (uncalibrated, calibrated), and the
    per-step relative error of each; plus the same over each step's op time."""
    preds = {"uncalibrated": predictor(config), "calibrated": predictor({**config, "calibration": str(calibration)})}
    out: dict = {}
    kinds = sorted({r[1] for r in report["step_kinds"]})
    for kind in kinds:
        rows = [r for r in report["step_kinds"] if r[1] == kind and r[4] > 0]
        units = np.array([r[2] for r in rows], dtype=float)
        meas = np.array([r[4] for r in rows])
        entry = {"steps": len(rows), "units": int(units.sum()), "measured_s": float(meas.sum())}
        for name, p in preds.items():
            pred = np.array([p(kind, u) for u in units])
            entry[name] = {"predicted_s": float(pred.sum()), "per_step": error_stats(pred, meas)}
        out[kind] = entry
    per_step: dict[int, list[float]] = {}
    for step, kind, units, _, seconds, *_ in report["step_kinds"]:
        acc = per_step.setdefault(step, [0.0, 0.0, 0.0])
        acc[0] += seconds
        acc[1] += preds["uncalibrated"](kind, units)
        acc[2] += preds["calibrated"](kind, units)
    v = np.array([x for x in per_step.values() if x[0] > 0])
    out["step (all ops)"] = {"steps": len(v), "measured_s": float(v[:, 0].sum()),
                             "uncalibrated": {"predicted_s": float(v[:, 1].sum()), "per_step": error_stats(v[:, 1], v[:, 0])},
                             "calibrated": {"predicted_s": float(v[:, 2].sum()), "per_step": error_stats(v[:, 2], v[:, 0])}}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw", type=Path)
    ap.add_argument("--calibration", type=Path, default=None, help="default: results/<gpu>.calibration.json")
    args = ap.parse_args()
    raw = args.raw
    env = json.loads((raw / "env.json").read_text())
    gpu = gpu_of_name(env["device"])
    results = raw.parent.parent
    cal_path = args.calibration or results / f"{gpu}.calibration.json"
    rows = json.loads((raw / "calibration_rows.json").read_text())
    steps = [r for r in rows if r["name"] == "forward_step"]
    out = {
        "device": env["device"], "gpu": gpu, "torch": env["torch"], "triton": env["triton"], "cuda": env["cuda"],
        "commands": {
            "all measurements": "bash benchmarks/gpu_session.sh OUTDIR env tests bench calibrate steps replay",
            "cuda tests": "python -m pytest tests/gpu -m cuda",
            "bench": [json.loads((raw / f).read_text())["command"] for f in ("bench_fp16_b16.json", "bench_bf16_b32.json")],
            "calibrate": "kvsim calibrate --device cuda --out CAL --rows ROWS",
            "replay": "kvsim gpu-replay RUN --device cuda --layers 32 --kv-heads 8 --head-dim 128 --q-per-kv 4",
            "this file": f"python benchmarks/gpu_results.py {raw}",
        },
        "calibration_profile": str(cal_path),
        "cuda_tests": (raw / "cuda_tests.log").read_text().strip().splitlines()[-1],
        "bench": {f.stem: {k: v for k, v in json.loads(f.read_text())["figures"].items()}
                  for f in sorted(raw.glob("bench_*.json"))},
        "step_time": step_accuracy(steps, gpu, load_calibration(cal_path)),
    }
    rep_file = raw / "replay_default.json.gz"
    if rep_file.exists():
        report = json.loads(gzip.open(rep_file).read())
        out["replay_default"] = {
            k: report[k] for k in ("steps", "steps_checked", "ops", "units", "launches", "tokens_verified",
                                   "sequence_checks", "decode_checks", "mismatches", "geometry", "dtype")}
        out["replay_default"]["accuracy"] = replay_accuracy(
            report, json.loads((raw / "config_default.json").read_text()), cal_path)
    dest = results / f"{gpu}.json"
    dest.write_text(json.dumps(out, indent=1) + "\n")
    print(tables(out))
    print(f"wrote {dest}")
    return 0


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def tables(out: dict) -> str:
    """Markdown tables of the accuracy figures (the bench figures are listed by bench_gpu's own log)."""
    lines = ["| step-time error (\\|pred/meas - 1\\|) | points | uncalibrated median / p90 | calibrated median / p90 |",
             "|---|---|---|---|"]
    st = out["step_time"]
    for key in st["uncalibrated"]:
        u, c = st["uncalibrated"][key], st["calibrated"][key]
        lines.append(f"| {key} | {u['n']} | {_pct(u['median'])} / {_pct(u['p90'])} | "
                     f"{_pct(c['median'])} / {_pct(c['p90'])} |")
    if "replay_default" in out:
        lines += ["", "| op kind (default-workload replay) | steps | measured | predicted uncal. / cal. | "
                  "per-step error uncal. median / p90 | cal. median / p90 |", "|---|---|---|---|---|---|"]
        for kind, e in out["replay_default"]["accuracy"].items():
            u, c = e["uncalibrated"], e["calibrated"]
            lines.append(f"| {kind} | {e['steps']} | {e['measured_s'] * 1e3:.1f} ms | {u['predicted_s'] * 1e3:.1f} / "
                         f"{c['predicted_s'] * 1e3:.1f} ms | {_pct(u['per_step']['median'])} / {_pct(u['per_step']['p90'])} "
                         f"| {_pct(c['per_step']['median'])} / {_pct(c['per_step']['p90'])} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
