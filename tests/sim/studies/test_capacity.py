"""`kvsim capacity`: the highest rate meeting TTFT and TPOT targets (sim/studies/capacity.py).

The search is checked on hand-made attainment curves (exact probe sequences), then on the
embedded workload: the answer meets the targets, a rate just above it does not, and a plain
`kvsim.simulate` at that load agrees. Goodput as DistServe (OSDI 2024, section 2) defines it.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import kvsim
from kvsim.sim.cli.app import app
from kvsim.sim.engine.config import ConfigError
from kvsim.sim.studies.capacity import Capacity, Probe, check_targets, search

runner = CliRunner()
TARGETS = {"slo_ttft": 0.5, "slo_tpot": 0.05}


def _cliff(at: float):
    """An attainment curve: every request meets the targets up to load `at`, half of them above."""
    calls: list[list[float]] = []

    def evaluate(loads: list[float]) -> list[dict]:
        calls.append(list(loads))
        return [{"slo_attainment": 1.0 if x <= at else 0.5} for x in loads]

    return evaluate, calls


def test_doubling_brackets_then_bisection_narrows_to_the_tolerance():
    evaluate, calls = _cliff(3.3)
    probes, best, above = search(evaluate, 2.0, attainment=0.9, tolerance=0.02)
    assert calls[:3] == [[1.0], [2.0], [4.0]]
    assert calls[3] == [pytest.approx(8 ** 0.5)]  # the geometric middle of [2, 4]
    assert best.load <= 3.3 < above.load and above.load / best.load <= 1.02
    assert best.rate_rps == 2.0 * best.load and [p.meets for p in probes[:3]] == [True, True, False]


def test_halving_when_the_workloads_own_rate_misses():
    evaluate, calls = _cliff(0.3)
    _, best, above = search(evaluate, 1.0, attainment=0.9)
    assert calls[:3] == [[1.0], [0.5], [0.25]]
    assert best.load <= 0.3 < above.load


def test_workers_probe_several_loads_a_round():
    evaluate, calls = _cliff(3.3)
    _, best, above = search(evaluate, 1.0, attainment=0.9, workers=3)
    assert calls[:2] == [[1.0], [2.0, 4.0, 8.0]]
    assert len(calls[2]) == 3 and all(2.0 < x < 4.0 for x in calls[2])
    assert best.load <= 3.3 < above.load and above.load / best.load <= 1.02


def test_a_load_that_always_meets_stops_at_the_last_doubling():
    evaluate, _ = _cliff(1e9)
    probes, best, above = search(evaluate, 1.0, attainment=0.9)
    assert above is None and best.load == 4096.0 and len(probes) == 13


def test_the_cost_per_million_output_tokens_is_the_gpus_hour_over_the_tokens_an_hour():
    best = Probe(2.0, 10.0, 0.95, True, {"output_tokens_per_s": 1000.0})
    c = Capacity(0.5, 0.05, 0.9, 2, [best], best, None, gpu_hourly_cost=3.6)
    # 2 GPUs x $3.6 an hour = $7.2 for 3.6M tokens: $2 a million
    assert c.cost_per_million_output_tokens == pytest.approx(2.0)
    assert c.rate_per_gpu == 5.0


@pytest.mark.parametrize(("args", "message"), [
    ((0.0, 0.05, 0.9), "slo_ttft must be a positive number of seconds, got 0.0"),
    ((0.5, float("nan"), 0.9), "slo_tpot must be a positive number of seconds, got nan"),
    ((0.5, 0.05, 1.5), "attainment must be in (0, 1], got 1.5"),
])
def test_targets_no_search_can_use_are_refused(args, message):
    with pytest.raises(ConfigError) as e:
        check_targets(*args)
    assert str(e.value) == message


def test_on_the_default_workload_the_answer_meets_and_a_rate_just_above_misses():
    c = kvsim.capacity(**TARGETS, workers=2)
    assert c.best.attainment >= 0.9 > c.above.attainment
    assert c.above.load / c.best.load <= 1.02
    again = kvsim.simulate(load=c.best.load, **TARGETS).summary  # kvsim run's default cache, as capacity
    assert again["slo_attainment"] == c.best.attainment


def test_the_command_prints_the_rate_per_gpu_and_attainment_as_json():
    r = runner.invoke(app, ["capacity", "--slo-ttft", "0.5", "--slo-tpot", "0.05", "--json", "--workers", "1"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout.strip().splitlines()[-1])
    want = kvsim.capacity(**TARGETS).as_dict()
    assert {k: out[k] for k in ("rate_rps", "rate_per_gpu", "attainment")} == \
        {k: want[k] for k in ("rate_rps", "rate_per_gpu", "attainment")}


def test_the_command_takes_runs_knobs_and_refuses_bad_targets():
    r = runner.invoke(app, ["capacity", "--slo-ttft", "0", "--slo-tpot", "0.05"])
    assert r.exit_code == 2 and "slo_ttft must be a positive number of seconds, got 0.0" in r.output
    r = runner.invoke(app, ["capacity", "--slo-ttft", "0.5", "--slo-tpot", "0.05", "--block-size", "12"])
    assert r.exit_code == 2 and "block_size must be a positive power of two, got 12" in r.output
