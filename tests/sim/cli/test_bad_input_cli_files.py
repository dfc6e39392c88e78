"""Bad run folders, sweep and baseline TOML files, calibration profiles and output paths, command
by command: one `error:` line naming the file, a non-zero exit, no traceback, nothing written."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvsim.sim.cli.app import app
from kvsim.sim.studies.run_folder import staged_folder
from tests.sim.cli.bad_input import PNG, assert_one_error, write_files

OK_RUN = ["run", "ok.jsonl", "--num-gpu-blocks", "64", "--record-ops", "--no-plots"]
BASELINE = 'kind = "hit_rate_vs_capacity"\nworkload = "../ok.jsonl"\n'
PARAMS = '[params]\ncapacities = [10]\npolicies = ["lru"]\n'
NOT_PARQUET = "not a parquet table (corrupt, or another format)"


@pytest.fixture(scope="module")
def good_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("good")
    write_files(root)
    r = CliRunner().invoke(app, [*OK_RUN[:1], str(root / "ok.jsonl"), *OK_RUN[2:], "-o", str(root / "run")])
    assert r.exit_code == 0, r.output
    return root / "run"


@pytest.fixture(autouse=True)
def in_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, good_run: Path) -> None:
    write_files(tmp_path)
    for name in ("good", "badsum", "badsteps", "badops"):
        shutil.copytree(good_run, tmp_path / name)
    (tmp_path / "badsum/summary.json").write_text("{nope")
    (tmp_path / "badsteps/steps.parquet").write_bytes(b"PAR1 cut short")
    (tmp_path / "badops/ops.parquet").write_text("junk")
    toml = {
        "sw_unknown.toml": '[base]\nworkload = "ok.jsonl"\nbogus = 1\n[grid]\neviction = ["lru"]\n',
        "sw_type.toml": '[base]\nworkload = "ok.jsonl"\n[grid]\nblock_size = ["x"]\n',
        "sw_empty.toml": '[base]\nworkload = "ok.jsonl"\n[grid]\neviction = []\n',
        "sw_nan.toml": '[base]\nworkload = "ok.jsonl"\n[grid]\nload = [nan]\n',
        "bl_toml/baseline.toml": "kind = ",
        "bl_tol/baseline.toml": BASELINE + "tolerance = nan\n" + PARAMS,
        "bl_caps/baseline.toml": BASELINE + PARAMS.replace("[10]", '[10, "x"]'),
        "bl_bs/baseline.toml": BASELINE + PARAMS + 'block_size = "x"\n',
        "bl_expected/baseline.toml": BASELINE + PARAMS,
    }
    for name, text in toml.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "sw_bin.toml").write_bytes(PNG)
    (tmp_path / "bl_expected/expected.json").write_bytes(PNG)
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["report", "fakerun"], "fakerun: not a complete run folder (no config.json)"),
        (["compare", "good", "fakerun"], "fakerun: not a complete run folder (no config.json)"),
        (["report", "badsum", "--no-plots"],
         "badsum/summary.json: not JSON (Expecting property name enclosed in double quotes, line 1)"),
        (["compare", "good", "badsteps"], f"badsteps/steps.parquet: {NOT_PARQUET}"),
        (["report", "ok.jsonl"], "ok.jsonl: not a run folder (no summary.json)"),
        (["report", "nope"], "nope: no such run folder"),
        (["compare", "good", "nope"], "nope: no such run folder"),
        (["compare", "adir"], "adir: not a run folder (no summary.json)"),
        (["compare", "good", "good", "--plot", "adir"], "adir: is a folder, expected a file name"),
    ],
)
def test_bad_run_folder(args: list[str], message: str) -> None:
    assert_one_error(args, message)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["sweep", "sw_unknown.toml"], "sw_unknown.toml [base]: unknown config key(s) 'bogus'"),
        (["sweep", "sw_type.toml"], "sw_type.toml [grid]: block_size must be int, got 'x'"),
        (["sweep", "sw_empty.toml"], "sw_empty.toml [grid]: eviction must be a non-empty list, got []"),
        (["sweep", "sw_bin.toml"], "sw_bin.toml: not UTF-8 text (byte 0x89 at offset 0)"),
        (["sweep", "sw_nan.toml"],
         "sw_nan.toml point load=nan_11690a70bf: load must be a positive finite number, got nan"),
        (["sweep", "adir"], "adir: cannot read (Is a directory)"),
        (["sweep", "sw_unknown.toml", "--workers", "0"], "--workers must be >= 1, got 0"),
        (["sweep", "sw_unknown.toml", "-o", "ok.jsonl"],
         "sw_unknown.toml [base]: unknown config key(s) 'bogus'"),
        (["regress", "bl_toml"], "bl_toml/baseline.toml: not valid TOML (Invalid value (at end of document))"),
        (["regress", "bl_tol"],
         "bl_tol/baseline.toml: tolerance of hit_rate must be a finite number >= 0, got nan"),
        (["regress", "bl_caps"],
         "bl_caps/baseline.toml [params]: capacity must be an integer number of blocks, got 'x'"),
        (["regress", "bl_bs"], "bl_bs/baseline.toml [params]: block_size must be an integer, got 'x'"),
        (["regress", "bl_expected"], "bl_expected/expected.json: not UTF-8 text (byte 0x89 at offset 0)"),
        (["regress", "adir"], "adir: no baseline.toml here or in its subfolders"),
    ],
)
def test_bad_settings_file(args: list[str], message: str) -> None:
    assert_one_error(args, message)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--calibration", "cal_nan.json"], "calibration cal_nan.json: overhead_s must be a number >= 0, got nan"),
        (["--calibration", "cal_inf.json"],
         "calibration cal_inf.json: efficiency.compute must be a positive number, got inf"),
        (["--calibration", "adir"], "calibration adir: cannot read (Is a directory)"),
        (["--calibration", "png.jsonl"], "calibration png.jsonl: not UTF-8 text (byte 0x89 at offset 0)"),
    ],
)
def test_bad_calibration_profile(args: list[str], message: str) -> None:
    assert_one_error(["run", "ok.jsonl", *args, "--no-plots", "-o", "r"], message)


@pytest.mark.parametrize(
    ("args", "message", "code"),
    [
        (["run", "ok.jsonl", "--no-plots", "-o", "ok.jsonl"], "ok.jsonl: exists and is not a folder", 2),
        (["run", "ok.jsonl", "--no-plots", "-o", "ok.jsonl/r"],
         "ok.jsonl/r: cannot write there (ok.jsonl is not a folder)", 2),
        (["curve", "ok.jsonl", "-c", "10", "-o", "ok.jsonl"], "ok.jsonl: exists and is not a folder", 2),
        (["cache-replay", "ok.jsonl", "-o", "adir"], "adir: is a folder, expected a file name", 2),
        (["cache-replay", "ok.jsonl", "-o", "nodir/x.jsonl"],
         "nodir/x.jsonl: cannot write there (nodir does not exist)", 2),
        (["workload", "generate", "default", "-o", "adir"], "adir: is a folder, expected a file name", 2),
        (["calibrate", "--out", "adir", "--device", "cpu"], "adir: is a folder, expected a file name", 2),
        (["calibrate", "--rows", "nodir/rows.json"], "nodir/rows.json: cannot write there (nodir does not exist)", 2),
        (["calibrate", "--block-size", "3", "--device", "cpu"],
         "block_size must be a positive power of two, got 3", 2),
        (["calibrate", "--refit", "png.jsonl"], "png.jsonl: not UTF-8 text (byte 0x89 at offset 0)", 2),
    ],
)
def test_bad_output_path_or_calibrate_input(args: list[str], message: str, code: int) -> None:
    assert_one_error(args, message, code)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["fakerun"], "fakerun/ops.parquet: missing; record the op stream with `kvsim run --record-ops` "
                      "(or KVCacheManager(record_ops=True) and manager.ops.save(folder))"),
        (["badops"], "badops/ops.parquet: not an op table (corrupt, or another format)"),
        (["ok.jsonl"], "ok.jsonl: no such run folder"),
        (["good", "--save", "adir"], "adir: is a folder, expected a file name"),
        (["good", "--swap-method", "magic"], "--swap-method must be kernel or torch, got 'magic'"),
        (["good", "--check-every", "0"], "--check-every must be >= 1, got 0"),
    ],
)
def test_gpu_replay_bad_input(args: list[str], message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # what --device cpu sets, undone after the test
    assert_one_error(["gpu-replay", args[0], "--device", "cpu", *args[1:]], message)


def test_staged_folder_is_written_whole_or_not_at_all(tmp_path: Path) -> None:
    root = tmp_path / "staged"
    root.mkdir()
    with pytest.raises(RuntimeError), staged_folder(root / "out") as d:
        (d / "a.txt").write_text("half")
        raise RuntimeError("the write failed")
    assert list(root.iterdir()) == []
    (root / "out").mkdir()
    (root / "out" / "old.txt").write_text("kept")
    with staged_folder(root / "out") as d:
        (d / "a.txt").write_text("whole")
    assert [p.name for p in root.iterdir()] == ["out"]
    assert sorted(p.name for p in (root / "out").iterdir()) == ["a.txt", "old.txt"]
