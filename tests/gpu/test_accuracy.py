"""The cost model against measured steps: error statistics, the fit, the holdout test, and calibrate --refit."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvsim.gpu.accuracy import (
    error_stats,
    fit_launches,
    fit_steps,
    holdout_accuracy,
    holdout_split,
    launches_of,
    main,
    predict_steps,
    step_accuracy,
)
from kvsim.sim.cli.app import app
from kvsim.sim.engine.catalog import get_gpu, get_model
from kvsim.sim.engine.cost_model import Calibration, CostModel
from kvsim.sim.engine.hf_config import model_spec

TRUE = Calibration(compute=0.62, attention=0.4, memory=0.75, serial_fraction=0.3, overhead_s=9e-4)


def _rows(cal=TRUE, models=(("llama-3-8b", 1), ("llama-3-70b", 2))):
    """Steps whose 'measured' time is the cost model's own under `cal` (TP all-reduce left out)."""
    rows = []
    for model, tp in models:
        for p, d, c, s in ((0, 1, 128, 1), (0, 64, 65536, 64), (0, 256, 262144, 256), (2048, 0, 2048, 1),
                           (512, 0, 4608, 1), (2048, 32, 67584, 33), (8192, 0, 8192, 1), (0, 16, 262144, 16)):
            cm = CostModel(model_spec(model), get_gpu("h100-sxm"), tp, calibration=cal)
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


def _saved_measurements(tmp_path) -> tuple[list[dict], Path]:
    """What `kvsim calibrate --rows` saves: the four block ops (1 ms each) and `_rows()`'s forward
    steps on an H100; returns the block ops and the file."""
    ops = [{"name": n, "seconds": 1e-3, "bytes": b} for n, b in
           (("copy_blocks", 2e6), ("exchange_blocks", 4e6), ("swap_out", 1e6), ("swap_in", 1e6))]
    steps = [{**r, "name": "forward_step", "seconds": r["measured_s"], "bytes": 0.0,
              "device": "NVIDIA H100 80GB HBM3"} for r in _rows()]
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps(ops + steps))
    return ops, rows


def test_refit_builds_a_profile_from_saved_measurements(tmp_path):
    ops, rows = _saved_measurements(tmp_path)
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


MODELS3 = (("llama-3-8b", 1), ("llama-3-70b", 2), ("qwen3-30b-a3b", 1))
HALF_A = [0, 2, 4, 5, 8, 10, 14, 15, 20, 21, 22, 23]  # seed 0's half A of _rows(models=MODELS3)


def test_holdout_split_is_seeded_half_of_each_group():
    rows = _rows(models=MODELS3)
    half_a, half_b = holdout_split(rows)
    assert (half_a, half_b) == (holdout_split(rows, seed=0)[0], holdout_split(list(rows), 0)[1])
    assert sorted(half_a + half_b) == list(range(24))
    assert [sum(1 for i in half_a if i // 8 == g) for g in range(3)] == [4, 4, 4]
    assert half_a == HALF_A
    assert holdout_split(rows, seed=1)[0] != half_a
    # a group's split does not depend on the other groups
    assert holdout_split(rows[8:])[0] == [i - 8 for i in half_a if i >= 8]


def test_holdout_recovers_a_known_calibration():
    result = holdout_accuracy(_rows(models=MODELS3), "h100-sxm")
    assert result["A"] == HALF_A and len(result["B"]) == 12
    for name in ("fit_A_test_B", "fit_B_test_A", "in_sample"):
        fit = result[name]
        assert fit["calibrated"]["all"]["n"] == (24 if name == "in_sample" else 12)
        assert fit["calibrated"]["all"]["max"] < 1e-3 < fit["uncalibrated"]["all"]["median"], name
        assert set(fit["calibrated"]) == {"all", "llama-3-8b tp1", "llama-3-70b tp2", "qwen3-30b-a3b tp1"}
        assert fit["calibration"] == pytest.approx({"compute": 0.62, "attention": 0.4, "memory": 0.75,
                                                    "serial_fraction": 0.3, "overhead_s": 9e-4}, rel=0.02)


def test_holdout_cli_prints_a_table(tmp_path, capsys):
    rows = _rows(models=MODELS3)
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps(rows[:16]))
    second.write_text(json.dumps([{"name": "copy_blocks", "seconds": 1e-3}, *rows[16:]]))  # an op row is skipped
    out = tmp_path / "holdout.json"
    main(["holdout", str(first), str(second), "--gpu", "h100-sxm", "--json", str(out)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "seed 0: half A 12 rows, half B 12"
    assert lines[2].startswith("fit_A_test_B: compute 0.62")
    assert [line.split()[:2] for line in lines[4:8]] == [["all", "12"], ["llama-3-70b", "tp2"],
                                                         ["llama-3-8b", "tp1"], ["qwen3-30b-a3b", "tp1"]]
    assert json.loads(out.read_text())["A"] == HALF_A
    bad = tmp_path / "bad.json"
    bad.write_text('[{"measured_s": 1}]\n{"x": 2}\n')
    for path, why in ((bad, "not JSON (Extra data, line 2)"), (tmp_path / "none.json", "cannot read (No such file or directory)"),
                      (out, "expected a JSON list of rows, got dict")):
        with pytest.raises(SystemExit):
            main(["holdout", str(path)])
        err = capsys.readouterr().err.strip().splitlines()
        assert f"error: {path}: " in err[-1] and why in err[-1], err


# --------------------------------------------------------------------------- per-launch cost


class _Pred:
    """A predictor charging 1 us per unit of every kind (the bytes' share of a replay's time)."""

    def __call__(self, kind, units):
        return 1e-6 * units


def _report(rows, layers=2, scale=0.5):
    return {"geometry": {"layers": layers}, "scale": scale, "step_kinds": rows}


def test_launches_of_reads_the_column_or_derives_it_for_old_reports():
    assert launches_of([3, "write", 10, 1, 1e-3, 7], 32) == 7
    assert launches_of([3, "write", 10, 2, 1e-3], 32) == 64  # a write region launched a kernel per layer
    assert launches_of([3, "move", 10, 2, 1e-3], 32) == 2


def test_fit_launches_recovers_a_known_launch_cost():
    # measured = bytes (1 us/unit x scale 0.5) + launches x cost: write 3 us, attention 12 us
    rows = [[s, k, u, 1, 0.5e-6 * u + x * n, n] for s, (k, x) in enumerate([("write", 3e-6), ("attention", 12e-6)] * 4)
            for u, n in ((4, 2), (100, 2), (7, 6))]
    fitted = fit_launches([(_report(rows), _Pred())])
    assert fitted == pytest.approx({"attention": 12e-6, "write": 3e-6}, rel=1e-9)
    # time the bytes already explain leaves nothing for launches (never negative); rows without time skip
    rows = [[0, "move", 10, 1, 1e-6 * 10, 1], [1, "move", 10, 1, 0.0, 1]]
    assert fit_launches([(_report(rows, scale=1.0), _Pred())]) == {"move": 0.0}


def test_calibrate_fits_launch_s_to_saved_replays(tmp_path):
    """kvsim calibrate --refit ROWS --replay REPORT[,CONFIG]: launch_s from the reports; a report
    without its run's config is refused naming the file and the fix."""
    import gzip

    _, rows = _saved_measurements(tmp_path)
    config = {"block_size": 16, "model": "llama-3-8b", "gpu": "h100-sxm"}
    step_kinds = [[s, "write", 1, 1, 5e-6 * n, n] for s, n in enumerate((1, 2, 4, 8))]
    report = {"geometry": {"layers": 8}, "scale": 0.0, "step_kinds": step_kinds}
    plain = tmp_path / "report.json.gz"
    with gzip.open(plain, "wt") as f:
        json.dump(report, f)
    conf = tmp_path / "config.json"
    conf.write_text(json.dumps(config))
    out = tmp_path / "cal.json"
    res = CliRunner().invoke(app, ["calibrate", "--refit", str(rows), "--replay", str(plain), "--out", str(out)])
    assert res.exit_code == 2 and f"{plain}: holds no run config" in res.output
    assert f"name it as {plain},RUN/config.json" in res.output
    res = CliRunner().invoke(app, ["calibrate", "--refit", str(rows), "--replay", f"{plain},{conf}", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["launch_s"] == {"write": pytest.approx(5e-6, rel=1e-9)}
    with_config = tmp_path / "with.json"
    with_config.write_text(json.dumps({**report, "config": config}))
    res = CliRunner().invoke(app, ["calibrate", "--refit", str(rows), "--replay", str(with_config), "--out", str(out)])
    assert res.exit_code == 0 and json.loads(out.read_text())["launch_s"]["write"] == pytest.approx(5e-6, rel=1e-9)
    res = CliRunner().invoke(app, ["calibrate", "--refit", str(rows), "--replay", str(tmp_path / "nope.json")])
    assert res.exit_code == 2 and "nope.json: cannot read (No such file or directory)" in res.output


def test_a_replays_prediction_scales_bytes_but_not_launches():
    """gpu.predict.Predictor.replay_s: the bytes' share scales to the replay's geometry, each launch
    costs its kind's launch_s whatever it moves (DEFAULT_LAUNCH_S uncalibrated)."""
    from kvsim.gpu.predict import Predictor, predictor
    from kvsim.sim.engine.cost_model import DEFAULT_LAUNCH_S

    p = Predictor({"write": 2e-6}, 1, "m", "g", launch_s={"write": 3e-6})
    assert p("write", 10) == pytest.approx(2e-5) and p.launches("write", 4) == pytest.approx(1.2e-5)
    assert p.replay_s("write", 10, 4, 0.5) == pytest.approx(1e-5 + 1.2e-5)
    assert p.replay_s("move", 10, 4, 0.5) == 0.0  # a kind it does not price
    assert predictor({"block_size": 16}).launch_s["attention"] == DEFAULT_LAUNCH_S
