"""Arrival processes and length distributions: statistics within tolerance, seeded determinism."""

import numpy as np
import pytest

from kvsim.workloads.arrivals import Constant, Gamma, Given, Poisson, make_arrivals
from kvsim.workloads.lengths import Empirical, Fixed, LogNormal, Uniform, parse_lengths
from kvsim.workloads.request import Workload, make_request


def rng(seed=0):
    return np.random.default_rng(seed)


def gaps(process, n=50_000, seed=0):
    t = process.times(n, rng(seed))
    assert t[0] == 0.0 and len(t) == n
    return np.diff(t)


@pytest.mark.parametrize("process", [Poisson(10.0), Gamma(10.0, 1.0)])
def test_poisson_like_gaps_have_mean_1_over_rate_and_cv_1(process):
    g = gaps(process)
    assert g.mean() == pytest.approx(0.1, rel=0.02)
    assert g.std() / g.mean() == pytest.approx(1.0, rel=0.03)


@pytest.mark.parametrize("cv", [0.5, 2.0, 3.0])
def test_gamma_cv_knob_sets_burstiness(cv):
    g = gaps(Gamma(10.0, cv))
    assert g.mean() == pytest.approx(0.1, rel=0.04)
    assert g.std() / g.mean() == pytest.approx(cv, rel=0.05)


def test_gamma_cv_zero_is_constant():
    assert Gamma(4.0, 0.0).times(4, rng()).tolist() == [0.0, 0.25, 0.5, 0.75]


def test_constant_and_given_are_exact():
    assert Constant(2.0).times(3, rng()).tolist() == [0.0, 0.5, 1.0]
    assert Given([0.0, 1.5, 1.5, 7.0]).times(3, rng()).tolist() == [0.0, 1.5, 1.5]
    with pytest.raises(ValueError, match="non-decreasing"):
        Given([2.0, 1.0]).times(2, rng())
    with pytest.raises(ValueError, match="only 1 timestamps"):
        Given([0.0]).times(2, rng())


def test_arrivals_are_deterministic_per_seed():
    a, b, c = (Gamma(3.0, 2.0).times(100, rng(s)) for s in (7, 7, 8))
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


def test_make_arrivals_names_and_errors():
    assert make_arrivals("gamma", 2.0, 3.0) == Gamma(2.0, 3.0)
    assert make_arrivals("poisson", 2.0) == Poisson(2.0)
    assert make_arrivals("constant", 2.0) == Constant(2.0)
    with pytest.raises(ValueError, match="unknown arrival process 'bursty'"):
        make_arrivals("bursty", 1.0)
    with pytest.raises(ValueError, match="rate must be > 0, got 0"):
        Poisson(0).times(3, rng())


def test_fixed_and_uniform_lengths():
    assert Fixed(7).sample(3, rng()).tolist() == [7, 7, 7]
    x = Uniform(10, 20).sample(20_000, rng())
    assert x.min() == 10 and x.max() == 20
    assert x.mean() == pytest.approx(15.0, rel=0.01)


def test_lognormal_mean_cv_and_clipping():
    x = LogNormal(200, 1.0).sample(50_000, rng())
    assert x.mean() == pytest.approx(200, rel=0.03)
    assert x.std() / x.mean() == pytest.approx(1.0, rel=0.06)
    y = LogNormal(200, 1.0, lo=50, hi=300).sample(5_000, rng())
    assert y.min() == 50 and y.max() == 300


def test_empirical_resamples_observed_values():
    e = Empirical(np.array([3, 3, 5, 100]))
    x = e.sample(20_000, rng())
    assert set(x.tolist()) == {3, 5, 100}
    assert x.mean() == pytest.approx(27.75, rel=0.05)
    reqs = [make_request(str(i), i, [0] * n, o) for i, (n, o) in enumerate([(4, 1), (6, 2)])]
    wl = Workload.from_list(reqs)
    assert Empirical.from_workload(wl, "prompt").values.tolist() == [4, 6]
    assert Empirical.from_workload(wl, "output").values.tolist() == [1, 2]


def test_lengths_are_deterministic_per_seed():
    for d in (Uniform(1, 100), LogNormal(50, 0.7), Empirical(np.arange(10))):
        assert np.array_equal(d.sample(50, rng(3)), d.sample(50, rng(3)))


def test_parse_lengths_specs(write):
    assert parse_lengths("fixed:12") == Fixed(12)
    assert parse_lengths("uniform:3,9") == Uniform(3, 9)
    assert parse_lengths("lognormal:100,0.5") == LogNormal(100.0, 0.5)
    path = write("w.jsonl", '{"id": "a", "arrival": 0, "prompt": [1, 2], "output_len": 9}\n')
    assert parse_lengths(f"empirical:{path}:output").values.tolist() == [9]
    assert parse_lengths(f"empirical:{path}").values.tolist() == [2]
    with pytest.raises(ValueError, match="bad length spec 'gauss:3'"):
        parse_lengths("gauss:3")
    with pytest.raises(ValueError, match="bad length spec 'uniform:3'"):
        parse_lengths("uniform:3")
