"""A run's summary says overload, drops and missing targets out loud (sim/engine/metrics.py
`load_figures`, sim/cli/report.py): offered against served rate, when the queue stopped
emptying, rejected requests with their reason, latencies in a unit a person reads, and no
goodput without an SLO."""

from __future__ import annotations

import pytest

from kvsim.sim.cli.report import format_table, reading
from kvsim.sim.studies.units import axis, seconds
from tests.sim.engine.engine_fixtures import req, run


@pytest.mark.parametrize(("v", "text"), [
    (0.0123, "12.3 ms"), (0.9994, "999.4 ms"), (4.561, "4.56 s"), (740.0, "12.3 min"),
    (8_033.446, "2.2 h"), (None, "-"),
])
def test_latencies_read_in_their_own_unit(v, text):
    assert seconds(v) == text


@pytest.mark.parametrize(("v", "scaled"), [
    (0.0, (0.0, "ms")), (0.25, (250.0, "ms")), (1.0, (1.0, "s")), (119.0, (119.0, "s")), (120.0, (2.0, "min")),
    (7199.0, (119.98, "min")), (7200.0, (2.0, "h")), (36_000.0, (10.0, "h")),
])
def test_a_plots_duration_axis_takes_the_unit_its_largest_value_reads_in(v, scaled):
    k, unit = axis(v)  # (the P/D plot's mean TTFT bar)
    assert (round(v * k, 2), unit) == scaled


def test_a_run_that_falls_behind_is_overloaded_from_the_start():
    # four requests 0.1 s apart, one at a time (max_num_seqs 1), 1 s a step: 10 offered req/s
    reqs = [req(f"r{i}", i / 10, 8, 4) for i in range(4)]
    s = run(reqs, max_num_seqs=1).summary
    assert s["offered_rps"] == pytest.approx(10.0) and s["served_rps"] == 4 / 16
    assert (s["overloaded"], s["overloaded_since_s"]) == (True, 0.0)
    assert reading(s).startswith("OVERLOADED: the engine served 0.250 of 10.000 offered requests/s; its "
                                 "waiting queue never emptied, so the latencies grow")
    assert "10.000 / 0.250  OVERLOADED" in format_table([s])


def test_a_run_that_keeps_up_is_not_and_has_no_goodput_without_an_slo():
    reqs = [req(f"r{i}", 10.0 * i, 8, 4) for i in range(3)]
    s = run(reqs).summary
    assert (s["offered_rps"], s["served_rps"], s["overloaded"], s["overloaded_since_s"]) == (0.1, 3 / 24, False, None)
    assert (s["goodput_rps"], s["slo_attainment"]) == (None, None)
    table = format_table([s])
    assert "goodput (req/s)" in table and "n/a (no SLO)" in table
    assert not reading(s).startswith("OVERLOADED")
    met = run(reqs, slo_ttft=2.0).summary
    assert (met["slo_attainment"], "100.00% met") == (1.0, "100.00% met") and "100.00% met" in format_table([met])


def test_rejected_requests_are_counted_with_their_reason():
    s = run([req("big", 0, 1000, 2), req("ok", 1, 8, 2)], num_gpu_blocks=8).summary
    assert s["rejected"] == 1
    assert "Of 2 requests, 1 was rejected (prompt exceeds cache: 1); they count in no latency." in reading(s)


def test_a_workload_with_no_reuse_does_not_say_the_policy_matters():
    s = run([req(f"r{i}", 5 * i, 16, 2) for i in range(6)], num_gpu_blocks=8).summary
    assert s["hit_tokens"] == 0 and s["evictions"] > 0
    words = reading(s)
    assert "no eviction policy can raise the hit rate" in words and "policy matters" not in words
