"""The run plots' arithmetic (sim/studies/plots.py): time slices averaged by duration, windowed
hit rates as sums, the compare legend's differing settings, and the helper's ideal hit rate."""

from __future__ import annotations

import numpy as np
import pytest

from kvsim.sim.cli.report import setting_labels
from kvsim.sim.studies.plots import resample
from tests.sim.engine.engine_fixtures import req, run


def test_a_slice_is_the_duration_weighted_mean_of_its_steps():
    t = np.array([0.0, 1.0, 2.0, 9.0])  # steps; the engine is idle from 3 s to 9 s
    d = np.array([1.0, 1.0, 1.0, 1.0])
    used = np.array([10.0, 20.0, 40.0, 5.0])
    starts, r = resample(t, d, {"used": used}, bins=3)  # slices of 3 s: [0, 3), [3, 6), [6, 9]
    assert starts.tolist() == [0.0, 3.0, 6.0]
    assert r["used"].tolist() == [pytest.approx(70 / 3), pytest.approx(70 / 3), 5.0]  # the idle slice keeps its value
    _, w = resample(t, np.array([2.0, 1.0, 1.0, 1.0]), {"used": used}, bins=3)
    assert w["used"][0] == pytest.approx((20 + 20 + 40) / 4)


def test_a_windowed_hit_rate_sums_its_slices():
    t = np.array([0.0, 0.5, 1.5, 2.5])
    _, r = resample(t, np.ones(4), {"prompt": np.array([10, 10, 0, 20]), "hit": np.array([5, 5, 0, 20])},
                    bins=2, how="sum")
    assert r["prompt"].tolist() == [20.0, 20.0] and r["hit"].tolist() == [10.0, 20.0]


def test_compare_names_runs_by_the_settings_that_differ():
    reqs = [req("a", 0, 8, 2)]
    a, b = run(reqs, eviction="lru"), run(reqs, eviction="s3fifo", block_size=8)
    assert setting_labels([a, b], ["x", "y"]) == ["block_size=4, eviction=lru", "block_size=8, eviction=s3fifo"]
    assert setting_labels([a, a], ["x", "y"]) == ["x", "y"]


def test_the_plot_helper_computes_the_workloads_ideal_hit_rate():
    from kvsim.sim.studies.plot_workers import _ideal
    from kvsim.workloads.default import default_workload
    from kvsim.workloads.stats import describe

    want = describe(default_workload(0), 16).ideal_token_hit_rate
    assert _ideal({"path": None, "format": "auto", "seed": 0, "block_size": 16}) == want
