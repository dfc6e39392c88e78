"""The cost model against measured steps: error statistics, the fit, and calibrate --refit."""

import json

import pytest
from typer.testing import CliRunner

from kvsim.gpu.accuracy import error_stats, fit_steps, predict_steps, step_accuracy
from kvsim.sim.cli.app import app
from kvsim.sim.engine.catalog import get_gpu, get_model
from kvsim.sim.engine.cost_model import Calibration, CostModel

TRUE = Calibration(compute=0.62, attention=0.4, memory=0.75, serial_fraction=0.3, overhead_s=9e-4)


def _rows(cal=TRUE):
    """Steps whose 'measured' time is the cost model's own under `cal` (TP all-reduce left out)."""
    rows = []
    for model, tp in (("llama-3-8b", 1), ("llama-3-70b", 2)):
        for p, d, c, s in ((0, 1, 128, 1), (0, 64, 65536, 64), (0, 256, 262144, 256), (2048, 0, 2048, 1),
                           (512, 0, 4608, 1), (2048, 32, 67584, 33), (8192, 0, 8192, 1), (0, 16, 262144, 16)):
            cm = CostModel(get_model(model), get_gpu("h100-sxm"), tp, calibration=cal)
            t = cm.step_time(p, d, c, s) - (p + d) * cm.allreduce_s_per_token
            rows.append({"model": model, "tp": tp, "prefill_tokens": p, "decode_tokens": d,
                         "context_tokens": c, "num_seqs": s, "measured_s": t})
    return rows


def test_error_stats_are_relative_errors():
    assert error_stats([1.1, 0.8, 1.0], [1.0, 1.0, 1.0]) == pytest.approx(
        {"n": 3, "median": 0.1, "p90": 0.18, "max": 0.2})


def test_predictions_reproduce_the_cost_model_and_the_fit_recovers_its_factors():
    rows = _rows()
    assert predict_steps(rows, TRUE, "h100-sxm") == pytest.approx([r["measured_s"] for r in rows], rel=1e-9)
    cal = fit_steps(rows, "h100-sxm")
    acc = step_accuracy(rows, "h100-sxm", cal)
    assert acc["calibrated"]["all"]["p90"] < 1e-3 < acc["uncalibrated"]["all"]["p90"]
    assert (cal.compute, cal.attention, cal.memory) == pytest.approx((0.62, 0.4, 0.75), rel=0.02)


def test_defaults_keep_the_plain_roofline():
    cm = CostModel(get_model("llama-3-8b"), get_gpu("h100-sxm"))
    tuned = CostModel(get_model("llama-3-8b"), get_gpu("h100-sxm"),
                      calibration=Calibration(attention=0.5, serial_fraction=0.0))
    assert cm.step_time(2048, 16, 40000, 17) == tuned.step_time(2048, 16, 40000, 17)


def test_refit_builds_a_profile_from_saved_measurements(tmp_path):
    ops = [{"name": n, "seconds": 1e-3, "bytes": b} for n, b in
           (("copy_blocks", 2e6), ("exchange_blocks", 4e6), ("swap_out", 1e6), ("swap_in", 1e6))]
    steps = [{**r, "name": "forward_step", "seconds": r["measured_s"], "bytes": 0.0,
              "device": "NVIDIA H100 80GB HBM3"} for r in _rows()]
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps(ops + steps))
    out = tmp_path / "cal.json"
    res = CliRunner().invoke(app, ["calibrate", "--refit", str(rows), "--out", str(out)])
    assert res.exit_code == 0, res.output
    prof = json.loads(out.read_text())
    assert prof["device"] == "h100-sxm" and prof["efficiency"]["attention"] == pytest.approx(0.4, rel=0.02)
    assert prof["op_cost_s"]["copy"] == pytest.approx(CostModel(get_model("llama-3-8b"), get_gpu("h100-sxm"))
                                                      .kv_bytes_per_block / 1e9)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(ops[:2]))
    res = CliRunner().invoke(app, ["calibrate", "--refit", str(bad)])
    assert res.exit_code == 2 and "lack the block ops swap_out, swap_in" in res.output
