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
