"""Sweeps: parsing and errors, stable point ids, resume after a kill, the table, Ray errors."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from kvsim.sim.cli.app import app
from kvsim.sim.engine.config import ConfigError
from kvsim.sim.studies.sweep import (
    WorkloadSpec,
    load_sweep,
    point_id,
    run_sweep,
    workload_key,
    write_json_atomic,
)

runner = CliRunner()
CALLS: list[dict] = []


def fake_point(params: dict, workload: WorkloadSpec) -> dict:
    """A cheap stand-in for a simulation: the summary echoes the point."""
    if params.get("num_gpu_blocks") == 666:
        raise KeyboardInterrupt  # the sweep is killed while running this point
    CALLS.append(params)
    return {"hit_rate": params["num_gpu_blocks"] / 1000, "workload": workload.name}


def write(tmp_path: Path, text: str, name: str = "sweep.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


SWEEP = """
[base]
workload = "w.jsonl"
block_size = 32

[grid]
eviction = ["lru", "s3fifo"]
num_gpu_blocks = [100, 200, 666]
"""


def test_points_in_file_order_with_stable_ids(tmp_path: Path) -> None:
    sw = load_sweep(write(tmp_path, SWEEP))
    pts = sw.points()
    assert [(p.params["eviction"], p.params["num_gpu_blocks"]) for p in pts] == [
        ("lru", 100), ("lru", 200), ("lru", 666), ("s3fifo", 100), ("s3fifo", 200), ("s3fifo", 666),
    ]  # fmt: skip
    assert pts[0].params == {
        "workload": "w.jsonl",
        "block_size": 32,
        "eviction": "lru",
        "num_gpu_blocks": 100,
    }
    assert pts[0].id == "eviction=lru,num_gpu_blocks=100_" + pts[0].id[-10:]
    # the id hashes every parameter: same params, same id; another base, another id
    assert pts[0].id == point_id(dict(pts[0].params), ["eviction", "num_gpu_blocks"])
    assert pts[0].id == "eviction=lru,num_gpu_blocks=100_c7856114f6"
    other = dict(pts[0].params, block_size=16)
    assert point_id(other, ["eviction", "num_gpu_blocks"]) != pts[0].id
    assert sw.workload(pts[0].params) == WorkloadSpec(str(tmp_path / "w.jsonl"), "auto")


W_JSONL = '{"id": "a", "arrival": 0, "prompt": [1, 2, 3], "output_len": 2}\n'


def test_resume_after_kill_skips_finished_points(tmp_path: Path) -> None:
    write(tmp_path, W_JSONL, "w.jsonl")
    sw = load_sweep(write(tmp_path, SWEEP))
    out = tmp_path / "out"
    CALLS.clear()
    with pytest.raises(KeyboardInterrupt):
        run_sweep(sw, out, point_fn=fake_point)
    assert [p["num_gpu_blocks"] for p in CALLS] == [100, 200]
    saved = sorted(p.name for p in (out / "points").iterdir())
    assert saved == [f"{pt.id}.json" for pt in sw.points()[:2]]
    assert not list((out / "points").glob(".*"))  # no temporary files left behind

    # the point that was killed no longer fails: the rerun does only what is missing
    sw.grid["num_gpu_blocks"] = [100, 200, 300]
    CALLS.clear()
    seen = []
    table = run_sweep(
        sw, out, point_fn=fake_point, on_point=lambda pt, rec, skipped: seen.append(skipped)
    )
    assert [(p["eviction"], p["num_gpu_blocks"]) for p in CALLS] == [
        ("lru", 300), ("s3fifo", 100), ("s3fifo", 200), ("s3fifo", 300),
    ]  # fmt: skip
    assert seen == [True, True, False, False, False, False]
    assert list(table.columns) == ["point", "eviction", "num_gpu_blocks", "hit_rate", "workload"]
    assert list(table["hit_rate"]) == [0.1, 0.2, 0.3, 0.1, 0.2, 0.3]
    pd.testing.assert_frame_equal(pd.read_parquet(out / "sweep.parquet"), table)
    rec = json.loads((out / "points" / f"{sw.points()[0].id}.json").read_text())
    assert rec == {
        "kvsim_sweep": 1,
        "id": sw.points()[0].id,
        "params": sw.points()[0].params,
        "workload_key": workload_key(sw.workload(sw.points()[0].params)),
        "summary": {"hit_rate": 0.1, "workload": "w.jsonl"},
    }


def test_a_changed_workload_file_reruns_its_points(tmp_path: Path) -> None:
    """Resume is keyed on the workload's content and kvsim's version, not its path."""
    write(tmp_path, W_JSONL, "w.jsonl")
    sw = load_sweep(write(tmp_path, SWEEP.replace("100, 200, 666", "100")))
    out = tmp_path / "out"
    run_sweep(sw, out, point_fn=fake_point)
    seen: list[bool] = []
    run_sweep(sw, out, point_fn=fake_point, on_point=lambda pt, rec, skipped: seen.append(skipped))
    assert seen == [True, True]  # unchanged: already done
    write(tmp_path, W_JSONL.replace('"output_len": 2', '"output_len": 3'), "w.jsonl")  # regenerated
    seen.clear()
    run_sweep(sw, out, point_fn=fake_point, on_point=lambda pt, rec, skipped: seen.append(skipped))
    assert seen == [False, False]


def test_a_sweep_over_a_missing_workload_leaves_nothing_behind(tmp_path: Path) -> None:
    cfg = write(tmp_path, SWEEP)
    out = tmp_path / "out"
    r = runner.invoke(app, ["sweep", str(cfg), "-o", str(out)])
    assert (r.exit_code, r.stderr) == (2, f"error: {tmp_path / 'w.jsonl'}: no such file or directory\n")
    assert not out.exists()


def test_parallel_sweep_runs_the_simulator(tmp_path: Path) -> None:
    from kvsim.sim.engine.config import SimConfig
    from kvsim.sim.engine.run import simulate

    golden = Path(__file__).parents[2] / "golden" / "workloads" / "shared-prefix.jsonl"
    path = write(tmp_path, f'[base]\nworkload = "{golden}"\n[grid]\nnum_gpu_blocks = [32, 64]\n')
    table = run_sweep(load_sweep(path), tmp_path / "out", workers=2)
    want = [
        simulate(WorkloadSpec(str(golden)).open(), SimConfig(num_gpu_blocks=n)).summary["hit_rate"]
        for n in (32, 64)
    ]
    assert list(table["hit_rate"]) == want
    assert list(table["num_gpu_blocks"]) == [32, 64]


def test_atomic_write_leaves_nothing_on_failure(tmp_path: Path) -> None:
    target = tmp_path / "p.json"
    with pytest.raises(TypeError):
        write_json_atomic(target, {"bad": object()})
    assert list(tmp_path.iterdir()) == []
    write_json_atomic(target, {"b": 1, "a": [2]})
    assert json.loads(target.read_text()) == {"a": [2], "b": 1}
    assert target.stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "[base]\nnum_gpu_block = 3\n",
            r"\[base\]: unknown config key\(s\) 'num_gpu_block' \(did you mean 'num_gpu_blocks'\?\)",
        ),
        (
            "[grid]\nevictoin = ['lru']\n",
            r"\[grid\]: unknown config key\(s\) 'evictoin' \(did you mean 'eviction'\?\)",
        ),
        (
            "[base]\nnum_gpu_blocks = '3'\n",
            r"\[base\]: num_gpu_blocks must be int \| None, got '3'",
        ),
        ("[grid]\nwatermark = [0.1, true]\n", r"\[grid\]: watermark must be float, got True"),
        ("[grid]\neviction = 'lru'\n", r"\[grid\]: eviction must be a non-empty list, got 'lru'"),
        (
            "[grid]\neviction = ['lru', 'mru']\n",
            r"point eviction=mru_\w+: unknown eviction policy 'mru'",
        ),
        ("[bsae]\n", r"unknown table or key 'bsae'; expected \[base\] and \[grid\]"),
        ("[base\n", r"not valid TOML"),
    ],
)
def test_sweep_file_errors(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=rf"^{path}.*{message}"):
        load_sweep(path)


def test_sweep_cli_error_is_one_line(tmp_path: Path) -> None:
    path = write(tmp_path, "[base]\nmodel = 'llama-3-70b'\n")
    res = runner.invoke(app, ["sweep", str(path), "-o", str(tmp_path / "out")])
    assert res.exit_code == 2
    assert res.output.startswith(f"error: {path} point ")
    assert "llama-3-70b does not fit on h100-sxm" in res.output
    assert len(res.output.splitlines()) == 1


def test_ray_missing_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails, installed or not
    path = write(tmp_path, "[grid]\nnum_gpu_blocks = [32]\n")
    res = runner.invoke(app, ["sweep", str(path), "--ray", "-o", str(tmp_path / "out")])
    assert res.exit_code == 2
    assert (
        res.output == "error: --ray needs Ray, which is not installed: pip install 'kvsim[ray]'\n"
    )


def test_unreachable_ray_cluster_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def init(**kwargs: object) -> None:
        raise ConnectionError("ray client connection timeout")  # what Ray says after 30 s

    fake = types.SimpleNamespace(is_initialized=lambda: False, init=init)
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.setenv("RAY_ADDRESS", "ray://127.0.0.1:10001")
    path = write(tmp_path, "[grid]\nnum_gpu_blocks = [32]\n")
    res = runner.invoke(app, ["sweep", str(path), "--ray", "-o", str(tmp_path / "out")])
    assert res.exit_code == 2
    assert res.output == (
        "error: --ray: cannot connect to the Ray cluster at ray://127.0.0.1:10001:"
        " ray client connection timeout\n"
    )
