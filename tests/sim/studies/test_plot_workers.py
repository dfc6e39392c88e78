"""The plot helpers of `kvsim run` draw the very files `write_plots` draws, and report failures."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsim.sim.studies.plot_workers import NAMES, PlotWorkers
from kvsim.sim.studies.plots import PLOTS, write_plots
from kvsim.sim.studies.run_folder import write_run
from tests.sim.engine.engine_fixtures import req, run


def test_the_helpers_share_out_every_plot_once_in_order() -> None:
    assert NAMES == PLOTS


def test_helpers_draw_the_same_files_as_the_command_did(tmp_path: Path) -> None:
    res = run([req("a", 0, 40, 30), req("b", 0.1, 40, 20), req("c", 0.2, 8, 5)], block_size=16, num_gpu_blocks=16)
    here = write_run(res, tmp_path / "here")
    with PlotWorkers() as workers:
        there = write_run(res, tmp_path / "there", draw=workers.draw)
    for name in PLOTS:
        assert (there / name).read_bytes() == (here / name).read_bytes(), name


def test_a_failed_helper_raises_with_its_traceback(tmp_path: Path) -> None:
    res = run([req("a", 0, 8, 2)])
    folder = write_run(res, tmp_path / "r", plots=False)
    (folder / "requests.parquet").unlink()  # the latency plot's table
    with PlotWorkers() as workers, pytest.raises(RuntimeError, match="requests.parquet"):
        workers.draw(res, folder)
    assert (folder / "blocks.png").is_file()  # the other helper's share was drawn


def test_helpers_never_asked_to_draw_stop_with_the_block(tmp_path: Path) -> None:
    with PlotWorkers() as workers:
        procs = [p for p, _ in workers._helpers]
    assert all(p.poll() is not None for p in procs)


def test_write_plots_draws_only_the_names_asked_for(tmp_path: Path) -> None:
    res = run([req("a", 0, 8, 2)])
    assert write_plots(res, tmp_path, ("latency.png",)) == [tmp_path / "latency.png"]
    assert [p.name for p in tmp_path.iterdir()] == ["latency.png"]


def test_a_share_whose_helper_died_is_drawn_by_the_command(tmp_path: Path) -> None:
    res = run([req("a", 0, 8, 2)])
    folder = write_run(res, tmp_path / "r", plots=False)
    with PlotWorkers() as workers:
        workers._helpers[0][0].kill()
        workers._helpers[0][0].wait()
        workers.draw(res, folder)
    assert sorted(p.name for p in folder.glob("*.png")) == sorted(PLOTS)


def test_a_helper_that_never_answers_is_stopped_and_its_share_drawn_by_the_command(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import kvsim.sim.studies.plot_workers as pw

    res = run([req("a", 0, 8, 2)])
    folder = write_run(res, tmp_path / "r", plots=False)
    monkeypatch.setattr(pw, "_SERVE", "import time; time.sleep(120)")  # a helper that hangs
    with PlotWorkers(timeout=1.0) as workers:
        procs = [p for p, _ in workers._helpers]
        workers.draw(res, folder)
    assert all(p.returncode is not None for p in procs)  # stopped, not left behind
    assert sorted(p.name for p in folder.glob("*.png")) == sorted(PLOTS)
    err = capsys.readouterr().err
    assert err.count("gave no answer in 1 s: stopped, and its plots drawn here") == 2
    assert "plot helper for blocks.png gave no answer" in err


def test_a_run_in_hybrid_groups_keeps_each_groups_blocks_in_use_in_its_folder(tmp_path: Path) -> None:
    """groups.parquet: one row a step, read back by `load_run` and by the helpers drawing blocks.png."""
    import pandas as pd

    from kvsim.sim.engine.config import SimConfig
    from kvsim.sim.engine.run import simulate
    from kvsim.sim.studies.run_folder import load_run
    from tests.sim.engine.test_engine import _mixed

    result = simulate(_mixed(), SimConfig(model="gpt-oss-20b", num_gpu_blocks=300))
    with PlotWorkers() as workers:
        write_run(result, tmp_path / "run", draw=workers.draw)
    back = load_run(tmp_path / "run")
    pd.testing.assert_frame_equal(back.group_usage, result.group_usage)
    assert list(back.group_usage.columns) == ["held_0", "held_1"] and len(back.group_usage) == len(back.steps)
    assert (tmp_path / "run" / "blocks.png").stat().st_size > 0
    one = simulate(_mixed(), SimConfig(num_gpu_blocks=300))  # one group: no such table
    assert one.group_usage is None
    assert not (write_run(one, tmp_path / "one", plots=False) / "groups.parquet").exists()
