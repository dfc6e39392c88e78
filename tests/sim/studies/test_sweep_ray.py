"""Sweeps on a local Ray instance: the local run's table, resume after a kill, errors, the CLI."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from kvsim.sim.cli.app import app
from kvsim.sim.engine.config import ConfigError
from kvsim.sim.studies.sweep import WorkloadSpec, load_sweep, run_sweep

ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'kvsim[ray]'")
# Ray's workers cannot import a test module by name: ship this module's functions by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

runner = CliRunner()
GOLDEN = Path(__file__).parents[2] / "golden" / "workloads" / "shared-prefix.jsonl"
FAKE = """
[base]
workload = "w.jsonl"
block_size = 32

[grid]
eviction = ["lru", "s3fifo"]
num_gpu_blocks = [100, 200, 300]
"""


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    """One local Ray instance for the module (start-up takes seconds), whatever RAY_ADDRESS says."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def fake_point(params: dict, workload: WorkloadSpec) -> dict:
    """A cheap stand-in for a simulation: the summary echoes the point."""
    if params["num_gpu_blocks"] == 666:
        raise ConfigError("point 666 is bad")
    return {"hit_rate": params["num_gpu_blocks"] / 1000, "workload": workload.name}


def logged_point(params: dict, workload: WorkloadSpec) -> dict:
    """`fake_point` that also notes each call in calls.log beside the workload (workers are processes)."""
    with open(Path(workload.path).parent / "calls.log", "a") as f:
        f.write(f"{params['eviction']} {params['num_gpu_blocks']}\n")
    return fake_point(params, workload)


def write(tmp_path: Path, text: str) -> Path:
    """The sweep file, and the small workload its points name (read for its content key)."""
    (tmp_path / "w.jsonl").write_text('{"id": "a", "arrival": 0, "prompt": [1, 2, 3], "output_len": 2}\n')
    path = tmp_path / "sweep.toml"
    path.write_text(text)
    return path


def test_ray_sweep_gives_the_local_table(tmp_path: Path) -> None:
    text = f'[base]\nworkload = "{GOLDEN}"\n[grid]\neviction = ["lru", "s3fifo"]\nnum_gpu_blocks = [32, 64]\n'
    path = write(tmp_path, text)
    local = run_sweep(load_sweep(path), tmp_path / "local")
    on_ray = run_sweep(load_sweep(path), tmp_path / "ray", use_ray=True)
    pd.testing.assert_frame_equal(on_ray, local)
    assert list(on_ray["eviction"]) == ["lru", "lru", "s3fifo", "s3fifo"]
    assert list(on_ray["num_gpu_blocks"]) == [32, 64, 32, 64]
    assert len(set(on_ray["hit_rate"])) == 4  # four different simulations, not one repeated
    names = sorted(p.name for p in (tmp_path / "local" / "points").iterdir())
    assert sorted(p.name for p in (tmp_path / "ray" / "points").iterdir()) == names
    for name in names:  # the saved points are the same bytes
        ray_bytes = (tmp_path / "ray" / "points" / name).read_bytes()
        assert ray_bytes == (tmp_path / "local" / "points" / name).read_bytes()


def test_killed_ray_sweep_resumes_without_redoing_points(tmp_path: Path) -> None:
    sw = load_sweep(write(tmp_path, FAKE))
    out = tmp_path / "out"
    fresh: list[str] = []

    def kill_after_two(pt, rec, skipped: bool) -> None:
        fresh.append(pt.id)
        if len(fresh) == 2:
            raise KeyboardInterrupt  # Ctrl-C on the driver once its second point is saved

    with pytest.raises(KeyboardInterrupt):
        run_sweep(sw, out, use_ray=True, point_fn=fake_point, on_point=kill_after_two)
    saved = sorted(p.stem for p in (out / "points").iterdir())
    assert saved == sorted(fresh)  # which two finish first is Ray's choice; exactly two do
    assert not list((out / "points").glob(".*"))  # no temporary files left behind

    seen: list[tuple[str, bool]] = []
    table = run_sweep(
        sw, out, use_ray=True, point_fn=logged_point,
        on_point=lambda pt, rec, skipped: seen.append((pt.id, skipped)),
    )  # fmt: skip
    points = sw.points()
    assert sorted(seen) == sorted((pt.id, pt.id in saved) for pt in points)
    calls = sorted((tmp_path / "calls.log").read_text().splitlines())
    assert calls == sorted(
        f"{pt.params['eviction']} {pt.params['num_gpu_blocks']}"
        for pt in points
        if pt.id not in saved
    )  # every point not saved ran once; no saved point ran again
    assert list(table["hit_rate"]) == [0.1, 0.2, 0.3, 0.1, 0.2, 0.3]
    whole = run_sweep(sw, tmp_path / "whole", point_fn=fake_point)  # uninterrupted, local
    pd.testing.assert_frame_equal(table, whole)
    pd.testing.assert_frame_equal(pd.read_parquet(out / "sweep.parquet"), whole)


def test_a_failing_point_raises_its_own_error(tmp_path: Path) -> None:
    sw = load_sweep(write(tmp_path, FAKE.replace("300", "666")))
    with pytest.raises(ConfigError) as info:
        run_sweep(sw, tmp_path / "out", use_ray=True, point_fn=fake_point)
    assert type(info.value) is ConfigError  # not Ray's wrapper, whose text is a traceback
    assert str(info.value) == "point 666 is bad"
    assert isinstance(info.value.__cause__, ray.exceptions.RayTaskError)


def test_cli_sweep_on_ray(tmp_path: Path) -> None:
    path = write(tmp_path, f'[base]\nworkload = "{GOLDEN}"\n[grid]\nnum_gpu_blocks = [32, 64]\n')
    out = tmp_path / "out"
    res = runner.invoke(app, ["sweep", str(path), "--ray", "-o", str(out)])
    assert res.exit_code == 0, res.output
    table = pd.read_parquet(out / "sweep.parquet")
    pd.testing.assert_frame_equal(table, run_sweep(load_sweep(path), tmp_path / "local"))
    lines = res.output.splitlines()
    assert len(lines) == 3
    assert [line[: line.index("]") + 1] for line in lines[:2]] == ["[1/2]", "[2/2]"]
    progress = sorted(line.split("] ", 1)[1] for line in lines[:2])  # in finishing order
    assert progress == sorted(
        f"{r.point}: hit rate {r.hit_rate:.2%}, {r.throughput_rps:.2f} req/s"
        for r in table.itertuples()
    )
    assert lines[2].startswith(f"wrote {out / 'sweep.parquet'} (2 points, ")

    res = runner.invoke(app, ["sweep", str(path), "--ray", "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert res.output.splitlines()[:2] == [
        f"[1/2] {table['point'][0]}: already done",
        f"[2/2] {table['point'][1]}: already done",
    ]
