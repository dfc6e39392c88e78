"""Gather one GPU's raw measurements (benchmarks/gpu_session.sh output) into results/<gpu>.json
and the tables of results/README.md's section for it.

    python benchmarks/gpu_results.py benchmarks/results/raw/h100-sxm [--calibration FILE]

Predictions are recomputed here from the raw files, uncalibrated and with the calibration
profile, so the accuracy figures can be re-derived on any machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from kvsim.gpu.accuracy import (
    error_stats,
    holdout_accuracy,
    launches_of,
    load_step_rows,
    predict_steps,
    step_accuracy,
)
from kvsim.gpu.calibrate import gpu_of_name
from kvsim.gpu.predict import predictor
from kvsim.gpu.report import load_report
from kvsim.sim.engine.cost_model import Calibration, load_calibration


def replay_accuracy(report: dict, config: dict, calibration: Path) -> dict:
    """Per op kind: units, measured and predicted seconds (uncalibrated, calibrated), and the
    per-step relative error of each; plus the same over each step's op time. A prediction is the
    cost model's bytes scaled to the replay's geometry plus the replay's launches priced
    (`Predictor.replay_s`): uncalibrated at DEFAULT_LAUNCH_S, calibrated at the profile's launch_s."""
    preds = {"uncalibrated": predictor(config), "calibrated": predictor({**config, "calibration": str(calibration)})}
    layers, scale = dict(report["geometry"])["layers"], report["scale"]
    rows = [(r[0], r[1], r[2], launches_of(r, layers), r[4]) for r in report["step_kinds"]]
    out: dict = {}
    for kind in sorted({r[1] for r in rows}):
        mine = [r for r in rows if r[1] == kind and r[4] > 0]
        meas = np.array([r[4] for r in mine])
        entry = {"steps": len(mine), "units": int(sum(r[2] for r in mine)),
                 "launches": int(sum(r[3] for r in mine)), "measured_s": float(meas.sum())}
        for name, p in preds.items():
            pred = np.array([p.replay_s(kind, r[2], r[3], scale) for r in mine])
            entry[name] = {"predicted_s": float(pred.sum()), "per_step": error_stats(pred, meas)}
        out[kind] = entry
    per_step: dict[int, list[float]] = {}
    for step, kind, units, launches, seconds in rows:
        acc = per_step.setdefault(step, [0.0, 0.0, 0.0])
        acc[0] += seconds
        acc[1] += preds["uncalibrated"].replay_s(kind, units, launches, scale)
        acc[2] += preds["calibrated"].replay_s(kind, units, launches, scale)
    v = np.array([x for x in per_step.values() if x[0] > 0])
    out["step (all ops)"] = {"steps": len(v), "measured_s": float(v[:, 0].sum()),
                             "uncalibrated": {"predicted_s": float(v[:, 1].sum()), "per_step": error_stats(v[:, 1], v[:, 0])},
                             "calibrated": {"predicted_s": float(v[:, 2].sum()), "per_step": error_stats(v[:, 2], v[:, 0])}}
    return out


REPLAYS = {  # name in the JSON: (report, the run's config) under raw/<gpu>/
    "default": ("replay_default.json.gz", "config_default.json"),
    "hybrid gpt-oss-20b": ("replay_hybrid_gpt-oss-20b.json.gz", "config_hybrid_gpt-oss-20b.json"),
    "hybrid gemma-3-27b": ("replay_hybrid_gemma-3-27b.json.gz", "config_hybrid_gemma-3-27b.json"),
}
REPLAY_KEYS = ("steps", "steps_checked", "ops", "units", "launches", "tokens_verified", "sequence_checks",
               "decode_checks", "mismatches", "geometry", "dtype", "check", "attention_layers")


def holdout(raw: Path, gpu: str, cal: Calibration) -> tuple[dict, list[dict]] | None:
    """The fresh forward steps (`gpu.forward_step --grid holdout`): the profile, fitted to the default
    grid's steps only, scored on them; and each model's fresh rows split in half, fitted on one half
    and scored on the other (`gpu.accuracy.holdout_accuracy`). Returns that and the rows."""
    # (a MoE's rows with its padded bmm experts, `holdout_*_bmm.json`, are kept apart: the same points)
    files = sorted(f for f in raw.glob("holdout_*.json") if not f.stem.endswith("_bmm"))
    if not files:
        return None
    rows = load_step_rows([str(f) for f in files])
    return {"files": [f.name for f in files], "profile_on_fresh": step_accuracy(rows, gpu, cal),
            "split": holdout_accuracy(rows, gpu)}, rows


def plot_steps(steps: list[dict], fresh: list[dict], gpu: str, cal: Calibration, dest: Path) -> None:
    """Predicted against measured step time, calibrated: the steps the profile was fitted to beside
    the fresh ones, a colour a model, the +-10 % band shaded (the figure the README's tables summarise)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("fitted to (default grid)", steps), ("fresh (holdout grid)", fresh)]
    fig, axes = plt.subplots(1, len(panels), figsize=(11, 5), sharex=True, sharey=True)
    models = sorted({(r["model"], int(r["tp"])) for r in steps + fresh})
    colours = dict(zip(models, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    lo = min(r["measured_s"] for r in steps + fresh) * 1e3 / 1.5
    hi = max(r["measured_s"] for r in steps + fresh) * 1e3 * 1.5
    line = np.geomspace(lo, hi, 50)
    for ax, (title, rows) in zip(axes, panels, strict=True):
        ax.fill_between(line, line * 0.9, line * 1.1, color="0.9", label="within 10 %")
        ax.plot(line, line, color="0.5", lw=0.8)
        for key in models:
            mine = [r for r in rows if (r["model"], int(r["tp"])) == key]
            if mine:
                pred = predict_steps(mine, cal, gpu) * 1e3
                ax.scatter([r["measured_s"] * 1e3 for r in mine], pred, s=14, color=colours[key],
                           label=f"{key[0]} tp{key[1]}")
        ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), title=title,
               xlabel="measured step (ms)")
        ax.grid(True, which="major", lw=0.3)
    axes[0].set_ylabel("cost model, calibrated (ms)")
    axes[-1].legend(loc="upper left", fontsize=8)
    fig.suptitle(f"{gpu}: whole forward steps against the calibrated cost model")
    fig.tight_layout()
    fig.savefig(dest, dpi=110)
    plt.close(fig)


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
    cal = load_calibration(cal_path)
    rows = json.loads((raw / "calibration_rows.json").read_text())
    steps = [r for r in rows if r["name"] == "forward_step"]
    replays = [(n, r, c) for n, (r, c) in REPLAYS.items() if (raw / r).exists()]
    replay_args = " ".join(f"--replay {raw / r},{raw / c}" for _, r, c in replays)
    out = {
        "device": env["device"], "gpu": gpu, "torch": env["torch"], "triton": env["triton"], "cuda": env["cuda"],
        "commands": {
            "all measurements": "bash benchmarks/gpu_session.sh OUTDIR env tests bench calibrate steps replay "
                                "holdout graphs pd mooncake hybrid",
            "cuda tests": "python -m pytest tests/gpu -m cuda",
            "bench": [json.loads(f.read_text())["command"] for f in sorted(raw.glob("bench_*.json"))],
            "calibrate": "kvsim calibrate --device cuda --out CAL --rows ROWS",
            "profile": f"kvsim calibrate --refit {raw / 'calibration_rows.json'} {replay_args} --out {cal_path}",
            "fresh steps": "python -m gpu.forward_step --model M --tp T --grid holdout --out ROWS",
            "holdout": f"python -m gpu.accuracy holdout {raw}/holdout_*.json --gpu {gpu}",
            "replay": "kvsim gpu-replay RUN --device cuda --layers 32 --kv-heads 8 --head-dim 128 --q-per-kv 4",
            "this file": f"python benchmarks/gpu_results.py {raw}",
        },
        "calibration_profile": str(cal_path),
        "cuda_tests": (raw / "cuda_tests.log").read_text().strip().splitlines()[-1],
        "bench": {f.stem: {k: v for k, v in json.loads(f.read_text())["figures"].items()}
                  for f in sorted(raw.glob("bench_*.json"))},
        "step_time": step_accuracy(steps, gpu, cal),
        "replays": {},
    }
    if (fresh := holdout(raw, gpu, cal)) is not None:
        out["holdout"], fresh_rows = fresh
        plot = results / f"{gpu}.steps.png"
        plot_steps(steps, fresh_rows, gpu, cal, plot)
        print(f"wrote {plot}")
    for name, rep_file, config_file in replays:
        report = load_report(f"{raw / rep_file},{raw / config_file}")
        entry = {k: report[k] for k in REPLAY_KEYS if k in report}
        entry["accuracy"] = replay_accuracy(report, report["config"], cal_path)
        out["replays"][name] = entry
    dest = results / f"{gpu}.json"
    dest.write_text(json.dumps(out, indent=1) + "\n")
    print(tables(out))
    print(f"wrote {dest}")
    return 0


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def _stats_row(key: str, u: dict, c: dict) -> str:
    return (f"| {key} | {u['n']} | {_pct(u['median'])} / {_pct(u['p90'])} | "
            f"{_pct(c['median'])} / {_pct(c['p90'])} |")


def tables(out: dict) -> str:
    """Markdown tables of the accuracy figures (the bench figures are listed by bench_gpu's own log)."""
    head = ["| step-time error (\\|pred/meas - 1\\|) | points | uncalibrated median / p90 | calibrated median / p90 |",
            "|---|---|---|---|"]
    lines = ["In-sample (the profile is fitted to these steps):", "", *head]
    st = out["step_time"]
    lines += [_stats_row(key, st["uncalibrated"][key], st["calibrated"][key]) for key in st["uncalibrated"]]
    if "holdout" in out:
        fresh = out["holdout"]["profile_on_fresh"]
        lines += ["", "Fresh steps, the profile above (fitted to the default grid alone):", "", *head]
        lines += [_stats_row(key, fresh["uncalibrated"][key], fresh["calibrated"][key]) for key in fresh["uncalibrated"]]
        for half in ("fit_A_test_B", "fit_B_test_A"):
            h = out["holdout"]["split"][half]
            lines += ["", f"Fresh steps split in half, {half.replace('_', ' ')} (factors fitted to the other half):",
                      "", *head]
            lines += [_stats_row(key, h["uncalibrated"][key], h["calibrated"][key]) for key in h["uncalibrated"]]
    for name, rep in out.get("replays", {}).items():
        lines += ["", f"| op kind ({name} replay) | steps | launches | measured | predicted uncal. / cal. | "
                  "per-step error uncal. median / p90 | cal. median / p90 |", "|---|---|---|---|---|---|---|"]
        for kind, e in rep["accuracy"].items():
            u, c = e["uncalibrated"], e["calibrated"]
            lines.append(f"| {kind} | {e['steps']} | {e.get('launches', '')} | {e['measured_s'] * 1e3:.1f} ms | "
                         f"{u['predicted_s'] * 1e3:.1f} / {c['predicted_s'] * 1e3:.1f} ms | "
                         f"{_pct(u['per_step']['median'])} / {_pct(u['per_step']['p90'])} "
                         f"| {_pct(c['per_step']['median'])} / {_pct(c['per_step']['p90'])} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
