"""How far the cost model's step and op times are from measured ones, and the calibration that
brings them closest (numpy only: runs on any machine from measurements taken on a GPU).

Step rows come from `gpu.forward_step` (one synthetic forward step each, in `CostModel.step_time`'s
terms); the TP all-reduce is not in those measurements, so it is left out of the prediction too.
Fitting follows Vidur's approach of profiling operators, with the cost model's five factors
(efficiency.compute / attention / memory, serial_fraction, overhead_s) chosen to minimise the
mean squared log error over every row. `holdout_accuracy` fits on half of each model's rows and
tests on the other half; `python -m gpu.accuracy holdout ROWS.json ...` prints it.
"""

from __future__ import annotations

import argparse
import functools
import json
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from kvsim.gpu.predict import Predictor
from kvsim.sim.engine.catalog import ModelSpec, get_gpu
from kvsim.sim.engine.cost_model import Calibration, CostModel
from kvsim.sim.engine.hf_config import model_spec
from kvsim.workloads.files import read_json

_OFF = 1e12  # an efficiency that makes a term vanish


def error_stats(predicted: Sequence[float], measured: Sequence[float]) -> dict[str, float]:
    """Median, p90 and max of |predicted / measured - 1| (and the count)."""
    p, m = np.asarray(predicted, dtype=float), np.asarray(measured, dtype=float)
    e = np.abs(p / m - 1.0)
    if not len(e):
        return {"n": 0}
    return {"n": int(len(e)), "median": float(np.median(e)), "p90": float(np.percentile(e, 90)),
            "max": float(e.max())}


@functools.cache
def _model(name: str) -> ModelSpec:
    """A row's model: a catalog name or one kept as a config (`hf_config.model_spec`), read once."""
    return model_spec(name)


def _terms(rows: Sequence[Mapping], gpu: str) -> np.ndarray:
    """Per row at efficiency 1: GEMM seconds, attention-score seconds, memory seconds; each prefill
    chunk's (prior, new) passed as the engine passes them (a row without its chunks: estimated)."""
    out = []
    for r in rows:
        args = (r["prefill_tokens"], r["decode_tokens"], r["context_tokens"], r["num_seqs"])
        chunks = [(int(p), int(n)) for p, n in r.get("prefill", ())]
        cols = []
        for c, a, m in ((1.0, _OFF, _OFF), (_OFF, 1.0, _OFF), (_OFF, _OFF, 1.0)):
            cal = Calibration(compute=c, attention=a, memory=m, overhead_s=0.0)
            cm = CostModel(_model(r["model"]), get_gpu(gpu), int(r["tp"]), calibration=cal)
            cols.append(cm.step_time(*args, None, chunks) - (args[0] + args[1]) * cm.allreduce_s_per_token)
        out.append(cols)
    return np.array(out)


def _predict(terms: np.ndarray, compute: float, attention: float, memory: float, serial: float,
             overhead: float) -> np.ndarray:
    c = terms[:, 0] / compute + terms[:, 1] / attention
    m = terms[:, 2] / memory
    return overhead + np.maximum(c, m) + serial * np.minimum(c, m)


def predict_steps(rows: Sequence[Mapping], calibration: Calibration | None, gpu: str) -> np.ndarray:
    """The cost model's step time for each measured row (TP all-reduce excluded)."""
    cal = calibration or Calibration()
    return _predict(_terms(rows, gpu), cal.compute, cal.attention or cal.compute, cal.memory,
                    cal.serial_fraction, cal.overhead_s)


def fit_steps(rows: Sequence[Mapping], gpu: str) -> Calibration:
    """The efficiencies, serial fraction and overhead that fit the measured steps best."""
    if len(rows) < 5:
        raise ValueError(f"fitting five factors needs at least 5 measured steps, got {len(rows)}")
    terms = _terms(rows, gpu)
    measured = np.array([r["measured_s"] for r in rows], dtype=float)

    def unpack(x: np.ndarray) -> tuple[float, ...]:
        eff = 1.0 / (1.0 + np.exp(-x[:3]))  # each efficiency in (0, 1)
        serial = 1.0 / (1.0 + np.exp(-x[3]))
        return (*eff, serial, float(np.exp(x[4])))

    def loss(x: np.ndarray) -> float:
        return float(np.mean(np.log(_predict(terms, *unpack(x)) / measured) ** 2))

    x = _nelder_mead(loss, np.array([0.0, 0.0, 1.4, -2.0, np.log(1e-3)]))
    c, a, m, s, o = unpack(x)
    return replace(Calibration(), compute=c, attention=a, memory=m, serial_fraction=s, overhead_s=o)


def _nelder_mead(f, x0: np.ndarray, step: float = 0.5, iters: int = 4000, tol: float = 1e-12) -> np.ndarray:
    """Minimise f from x0 (the standard reflect / expand / contract / shrink simplex)."""
    n = len(x0)
    pts = [x0] + [x0 + step * np.eye(n)[i] for i in range(n)]
    vals = [f(p) for p in pts]
    for _ in range(iters):
        order = np.argsort(vals)
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        if vals[-1] - vals[0] < tol:
            break
        centre = np.mean(pts[:-1], axis=0)
        refl = centre + (centre - pts[-1])
        fr = f(refl)
        if fr < vals[0]:
            exp = centre + 2 * (centre - pts[-1])
            fe = f(exp)
            pts[-1], vals[-1] = (exp, fe) if fe < fr else (refl, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = refl, fr
        else:
            con = centre + 0.5 * (pts[-1] - centre)
            fc = f(con)
            if fc < vals[-1]:
                pts[-1], vals[-1] = con, fc
            else:
                pts = [pts[0] + 0.5 * (p - pts[0]) for p in pts]
                vals = [f(p) for p in pts]
    return pts[int(np.argmin(vals))]


def launches_of(row: Sequence, layers: int) -> int:
    """Kernel launches of a replay report's step_kinds row. Reports written before launches were
    counted have five columns: there each timed write region launched a kernel per storage layer,
    and every other region one."""
    if len(row) > 5:
        return int(row[5])
    return int(row[3]) * (layers if row[1] == "write" else 1)


def fit_launches(replays: Sequence[tuple[Mapping, Predictor]]) -> dict[str, float]:
    """Seconds per kernel launch of each kind that best explain replays' measured time per (step, kind)
    beside the bytes the cost model charges (`Predictor.replay_s`): per kind over every replay, the
    non-negative x minimising the mean squared relative error of bytes + x * launches (closed form).
    `replays` pairs a report (`ReplayReport.as_dict()`) with its run's predictor."""
    num: dict[str, float] = {}
    den: dict[str, float] = {}
    for report, pred in replays:
        layers = dict(report["geometry"])["layers"]
        for row in report["step_kinds"]:
            kind, units, measured = row[1], row[2], row[4]
            launches = launches_of(row, layers)
            if measured <= 0 or not launches:
                continue
            rest = measured - pred(kind, units) * report["scale"]
            num[kind] = num.get(kind, 0.0) + launches * rest / measured**2
            den[kind] = den.get(kind, 0.0) + launches**2 / measured**2
    return {k: max(0.0, num[k] / den[k]) for k in sorted(num)}


def step_accuracy(rows: Sequence[Mapping], gpu: str, calibration: Calibration | None) -> dict:
    """Step-time error of the uncalibrated and the calibrated model, overall and per (model, tp)."""
    measured = [r["measured_s"] for r in rows]
    out: dict = {}
    for name, cal in (("uncalibrated", None), ("calibrated", calibration)):
        pred = predict_steps(rows, cal, gpu)
        out[name] = {"all": error_stats(pred, measured)}
        for key in sorted({(r["model"], int(r["tp"])) for r in rows}):
            idx = [i for i, r in enumerate(rows) if (r["model"], int(r["tp"])) == key]
            out[name][f"{key[0]} tp{key[1]}"] = error_stats(pred[idx], [measured[i] for i in idx])
    return out


def _key(row: Mapping) -> str:
    return f"{row['model']} tp{int(row['tp'])}"


def holdout_split(rows: Sequence[Mapping], seed: int = 0) -> tuple[list[int], list[int]]:
    """Row indices of halves A and B: each (model, tp)'s rows, in a permutation seeded by `seed`
    and a stable hash of the key (so one group's split does not depend on the others), give
    their first ceil(n / 2) to A and the rest to B."""
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault(_key(r), []).append(i)
    half_a, half_b = [], []
    for key, idx in groups.items():
        order = np.random.default_rng([seed, zlib.crc32(key.encode())]).permutation(len(idx))
        cut = (len(idx) + 1) // 2
        half_a += [idx[j] for j in order[:cut]]
        half_b += [idx[j] for j in order[cut:]]
    return sorted(half_a), sorted(half_b)


def holdout_accuracy(rows: Sequence[Mapping], gpu: str, seed: int = 0) -> dict:
    """Out-of-sample step error: fit `fit_steps` on half A of each (model, tp)'s rows
    (`holdout_split`), report `step_accuracy` on half B, and the reverse; "in_sample" fits and
    tests on every row, for comparison. Each entry holds its calibration's factors."""
    half_a, half_b = holdout_split(rows, seed)
    out: dict = {"seed": seed, "A": half_a, "B": half_b}
    for name, fit_on, test_on in (("fit_A_test_B", half_a, half_b), ("fit_B_test_A", half_b, half_a),
                                  ("in_sample", range(len(rows)), range(len(rows)))):
        cal = fit_steps([rows[i] for i in fit_on], gpu)
        out[name] = {"calibration": _factors(cal), **step_accuracy([rows[i] for i in test_on], gpu, cal)}
    return out


def _factors(cal: Calibration) -> dict[str, float]:
    """The five factors `fit_steps` fits."""
    d = asdict(cal)
    return {k: d[k] for k in ("compute", "attention", "memory", "serial_fraction", "overhead_s")}


def format_holdout(result: Mapping) -> str:
    """`holdout_accuracy`'s result as a table: per fit, its factors, then each group's error
    (median / p90 / max, %) uncalibrated and calibrated."""
    lines = [f"seed {result['seed']}: half A {len(result['A'])} rows, half B {len(result['B'])}"]
    for name in ("fit_A_test_B", "fit_B_test_A", "in_sample"):
        acc = result[name]
        lines += ["", f"{name}: " + "  ".join(f"{k} {v:.4g}" for k, v in acc["calibration"].items()),
                  f"  {'rows':<24} {'n':>3}   uncalibrated med / p90 / max %   calibrated med / p90 / max %"]
        for key, unc in acc["uncalibrated"].items():
            cal = acc["calibrated"][key]
            lines.append(f"  {key:<24} {unc['n']:>3}   {_pct(unc):>30}   {_pct(cal):>28}")
    return "\n".join(lines)


def _pct(stats: Mapping) -> str:
    if not stats["n"]:
        return "-"
    return " / ".join(f"{100 * stats[k]:.1f}" for k in ("median", "p90", "max"))


def load_step_rows(paths: Sequence[str]) -> list[dict]:
    """The step rows of JSON files (`gpu.forward_step`'s output, or a calibration run's rows, of
    which those with a measured step time)."""
    rows: list[dict] = []
    for path in paths:
        data = read_json(Path(path))
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list of rows, got {type(data).__name__}")
        rows += [r for r in data if "measured_s" in r]
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    """CLI: `holdout ROWS.json [ROWS2.json ...] --gpu h100-sxm [--seed 0] [--json OUT]`."""
    ap = argparse.ArgumentParser(prog="python -m gpu.accuracy", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    hold = sub.add_parser("holdout", help="fit on half of each model's steps, test on the other half")
    hold.add_argument("rows", nargs="+", help="JSON files of step rows (python -m gpu.forward_step --out)")
    hold.add_argument("--gpu", default="h100-sxm", help="the GPU the rows were measured on (catalog name)")
    hold.add_argument("--seed", type=int, default=0)
    hold.add_argument("--json", default=None, help="also write the result here")
    args = ap.parse_args(argv)
    try:
        rows = load_step_rows(args.rows)
    except ValueError as e:
        ap.error(str(e))
    result = holdout_accuracy(rows, args.gpu, args.seed)
    print(format_holdout(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
