"""Golden-curve regression: the checked-in baselines pass, a perturbed one fails with a diff."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvsim.sim.cli.app import app
from kvsim.sim.engine.config import ConfigError
from kvsim.sim.studies.regress import Row, baseline_folders, compare, format_diff, load_baseline

runner = CliRunner()
GOLDEN = Path(__file__).parents[2] / "golden"


def test_checked_in_baselines_pass() -> None:
    res = runner.invoke(app, ["regress", str(GOLDEN)])
    assert res.exit_code == 0, res.output
    assert [line.split()[:2] for line in res.output.splitlines()] == [
        ["ok", f"{GOLDEN}/multi-turn-fragmentation:"],
        ["ok", f"{GOLDEN}/multi-turn-hit-rate:"],
        ["ok", f"{GOLDEN}/shared-prefix-hit-rate:"],
    ]


def copy_baseline(tmp_path: Path, name: str) -> Path:
    shutil.copytree(GOLDEN / "workloads", tmp_path / "workloads")
    shutil.copytree(GOLDEN / name, tmp_path / name)
    return tmp_path / name


def test_perturbed_baseline_fails_with_a_diff_table(tmp_path: Path) -> None:
    folder = copy_baseline(tmp_path, "shared-prefix-hit-rate")
    path = folder / "expected.json"
    data = json.loads(path.read_text())
    points = data["points"]
    hit = points["lru capacity=64"]["hit_rate"]
    points["lru capacity=64"]["hit_rate"] = hit + 0.01
    points["fifo capacity=16"]["evicted_blocks"] += 3
    del points["cost capacity=256"]
    path.write_text(json.dumps(data))

    res = runner.invoke(app, ["regress", str(folder)])
    assert res.exit_code == 1
    lines = res.output.splitlines()
    assert lines[0] == f"FAIL {folder}: 6 of 100 values beyond tolerance"
    assert lines[1].split() == ["point", "expected", "got", "delta", "tolerance"]
    assert lines[2].split() == [
        "lru",
        "capacity=64",
        "hit_rate",
        f"{hit + 0.01:.6g}",
        f"{hit:.6g}",
        "-0.01",
        "1e-09",
    ]
    fifo = points["fifo capacity=16"]["evicted_blocks"]
    assert lines[3].split() == [
        "fifo",
        "capacity=16",
        "evicted_blocks",
        str(fifo),
        str(fifo - 3),
        "-3",
        "0",
    ]
    assert [line.split()[:4] for line in lines[4:]] == [
        ["cost", "capacity=256", "hit_rate", "(new)"],
        ["cost", "capacity=256", "block_hit_rate", "(new)"],
        ["cost", "capacity=256", "evicted_blocks", "(new)"],
        ["cost", "capacity=256", "mean_id_fragmentation", "(new)"],
    ]

    # --update accepts the new values; the next run passes
    res = runner.invoke(app, ["regress", str(folder), "--update"])
    assert res.exit_code == 0 and res.output.startswith(f"updated {path} (100 values")
    assert json.loads(path.read_text()) == json.loads(
        (GOLDEN / "shared-prefix-hit-rate" / "expected.json").read_text()
    )
    assert runner.invoke(app, ["regress", str(folder)]).exit_code == 0


def test_compare_and_format_diff() -> None:
    b = load_baseline(GOLDEN / "multi-turn-fragmentation")
    cmp = compare(
        b,
        {"lru t=0s": {"used_blocks": 7, "gone": 1}},
        {"lru t=0s": {"used_blocks": 9}, "x": {"m": 1.5}},
    )
    assert [(r.point, r.ok) for r in cmp.rows] == [
        ("lru t=0s used_blocks", False), ("lru t=0s gone", False), ("x m", False),
    ]  # fmt: skip
    assert format_diff(cmp.rows) == (
        "point                 expected      got  delta  tolerance\n"
        "lru t=0s used_blocks         7        9     +2          0\n"
        "lru t=0s gone                1  missing      -          0\n"
        "x m                      (new)      1.5      -          0"
    )
    assert Row("p", 0.5, 0.5 + 1e-10, 1e-9).ok and not Row("p", 0.5, 0.6, 1e-9).ok


def test_generator_baseline(tmp_path: Path) -> None:
    folder = tmp_path / "gen"
    folder.mkdir()
    (folder / "baseline.toml").write_text(
        'kind = "hit_rate_vs_capacity"\nmetrics = ["hit_rate"]\n'
        '[generator]\nkind = "shared-prefix"\nnum_requests = 30\nseed = 3\nprefix_len = "fixed:64"\n'
        '[params]\ncapacities = [8, 64]\npolicies = ["lru"]\n'
    )
    assert runner.invoke(app, ["regress", str(folder), "--update"]).exit_code == 0
    points = json.loads((folder / "expected.json").read_text())["points"]
    assert list(points) == ["lru capacity=8", "lru capacity=64"]
    assert points["lru capacity=8"]["hit_rate"] < points["lru capacity=64"]["hit_rate"]
    assert runner.invoke(app, ["regress", str(folder)]).exit_code == 0


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        (
            'kind = "hit_rate_vs_capacity"\nworklaod = "w.jsonl"\n',
            r"unknown key 'worklaod' \(did you mean 'workload'\?\)",
        ),
        (
            'kind = "latency"\n',
            r"kind must be one of hit_rate_vs_capacity, fragmentation_over_time, got 'latency'",
        ),
        (
            'kind = "hit_rate_vs_capacity"\n[params]\ncapacity = [1]\n',
            r"\[params\]: unknown key 'capacity' \(did you mean 'capacities'\?\)",
        ),
        (
            'kind = "hit_rate_vs_capacity"\n[params]\npolicies = ["lru"]\n',
            r"\[params\]: capacities must be a non-empty list",
        ),
        (
            'kind = "fragmentation_over_time"\n[params]\npolicies = ["lru"]\nsample_every_s = 0\n',
            r"sample_every_s must be a positive number, got 0",
        ),
        (
            'kind = "fragmentation_over_time"\n[params]\npolicies = ["lru"]\nsample_every_s = 1\n[params.config]\nblock_sz = 16\n',
            r"\[params.config\]: unknown config key\(s\) 'block_sz'",
        ),
        (
            'kind = "hit_rate_vs_capacity"\nmetrics = ["hit_rate"]\n[tolerance]\nhitrate = 0.1\n',
            r"\[tolerance\]: unknown key 'hitrate' \(did you mean 'hit_rate'\?\)",
        ),
    ],
)
def test_baseline_errors(tmp_path: Path, toml: str, message: str) -> None:
    (tmp_path / "baseline.toml").write_text(toml)
    with pytest.raises(ConfigError, match=rf"^{tmp_path}/baseline.toml.*{message}"):
        load_baseline(tmp_path)


def test_cli_errors_are_one_line(tmp_path: Path) -> None:
    res = runner.invoke(app, ["regress", str(tmp_path)])
    assert (res.exit_code, res.output) == (
        2,
        f"error: {tmp_path}: no baseline.toml here or in its subfolders\n",
    )
    folder = copy_baseline(tmp_path, "shared-prefix-hit-rate")
    (folder / "expected.json").unlink()
    res = runner.invoke(app, ["regress", str(folder)])
    assert res.exit_code == 2
    assert (
        res.output
        == f"error: {folder}/expected.json: missing; create it with `kvsim regress {folder} --update`\n"
    )
    assert baseline_folders(tmp_path) == [folder]
