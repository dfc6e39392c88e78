"""simulate / write_run / load_run: exact hit accounting, the run folder and its round trip."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kvsim.kvcache.ops import read_ops
from kvsim.sim.engine.metrics import STEP_FIELDS
from kvsim.sim.engine.run import RunResult, rare_collections
from kvsim.sim.studies.plots import PLOTS
from kvsim.sim.studies.run_folder import load_run, write_run
from tests.sim.engine import engine_fixtures
from tests.sim.engine.engine_fixtures import req

PNG = b"\x89PNG\r\n\x1a\n"


def run(requests: list, step_s: float = 1.0, **cfg) -> RunResult:
    """`engine_fixtures.run` under the sync scheduler (the steps and latencies below are worked out for it)."""
    return engine_fixtures.run(requests, step_s, **{"async_scheduling": False, **cfg})


def shared_prefix_requests() -> list:
    """Three 36- to 48-token prompts behind one 32-token system prompt, one after another."""
    system = np.arange(1000, 1032)
    return [
        req("a", 0, np.concatenate([system, np.arange(4)]), 2),
        req("b", 10, np.concatenate([system, np.arange(10, 26)]), 2),
        req("c", 20, np.concatenate([system, np.arange(10, 26)]), 2),  # b's whole prompt again
    ]


def test_hit_tokens_on_a_shared_prefix() -> None:
    res = run(shared_prefix_requests(), block_size=16, num_gpu_blocks=32)
    # b hits the 2 system blocks; c hits b's 3 full blocks, and not its last token's block
    assert res.requests["hit_tokens"].tolist() == [0, 32, 32]
    s = res.summary
    assert (s["prompt_tokens"], s["hit_tokens"]) == (36 + 48 + 48, 64)
    assert s["hit_rate"] == 64 / 132
    assert s["block_hit_rate"] == 4 / (3 + 3 + 3)
    assert res.steps["admitted_hit_tokens"].sum() == 64


def test_summary_counts_and_latencies() -> None:
    s = run([req("a", 0, 8, 4), req("b", 0, 8, 2)]).summary
    assert (s["requests"], s["finished"], s["rejected"], s["steps"]) == (2, 2, 0, 4)
    assert s["duration_s"] == 4.0 and s["throughput_rps"] == 0.5
    assert s["output_tokens"] == 6 and s["output_tokens_per_s"] == 1.5
    assert (s["ttft_p50"], s["e2e_p50"], s["tpot_p50"]) == (1.0, 3.0, 1.0)
    assert s["peak_used_blocks"] == 4 and s["num_gpu_blocks"] == 16  # at step ends, after frees


def test_the_summary_reads_statuses_as_codes_and_as_strings_alike() -> None:
    """`summarize` counts statuses and drop reasons off the categorical codes `RequestLog.frame`
    makes (`metrics.codes`); a table whose columns hold the same values as plain strings (a table
    read back some other way) gives the same summary, and a value not among the names counts in
    none of them."""
    from kvsim.sim.engine.metrics import REASONS, STATUS, codes, summarize

    res = run([req("a", 0, 8, 4), req("b", 0, 40, 2), req("c", 0, 8, 2)], num_gpu_blocks=4)
    plain = res.requests.astype({"status": object, "reason": object})
    kw = {"block_size": res.config.block_size, "num_gpu_blocks": 4}
    assert summarize(res.steps, plain, **kw) == summarize(res.steps, res.requests, **kw)
    assert (res.summary["finished"], res.summary["rejected"], res.summary["dropped_prompt_exceeds_cache"]) == (2, 1, 1)
    assert codes(pd.Series(["finished", "rejected", "lost"]), STATUS).tolist() == [1, 3, -1]
    assert codes(res.requests["reason"], REASONS).tolist() == [0, REASONS.index("prompt_exceeds_cache"), 0]


def test_goodput_counts_requests_within_the_slos() -> None:
    reqs = [req("a", 0, 8, 4), req("b", 0.5, 8, 2)]
    assert run(reqs).summary["goodput_rps"] is None  # no SLO: no goodput (not the throughput)
    slo = run(reqs, slo_ttft=1.0).summary  # b waits for the next step: ttft 1.5
    assert (slo["goodput_rps"], slo["slo_attainment"]) == (1 / 4, 0.5)


def test_run_folder_round_trip(tmp_path: Path) -> None:
    res = run(shared_prefix_requests(), block_size=16, num_gpu_blocks=32, record_ops=True)
    out = write_run(res, tmp_path / "r")
    names = {"config.json", "steps.parquet", "requests.parquet", "summary.json", "ops.parquet", "op_tokens.parquet", *PLOTS}
    assert {p.name for p in out.iterdir()} == names
    assert all((out / p).read_bytes()[:8] == PNG for p in PLOTS)
    assert json.loads((out / "config.json").read_text())["block_size"] == 16
    back = load_run(out)
    pd.testing.assert_frame_equal(back.steps, res.steps)
    pd.testing.assert_frame_equal(back.requests, res.requests)
    assert back.summary == json.loads(json.dumps(res.summary)) and back.config == res.config
    assert list(back.steps.columns) == list(STEP_FIELDS)
    ops = read_ops(out / "ops.parquet")
    assert sum(op.kind == "write" for op in ops) == res.manager.ops.counts["write"]


def test_ops_are_written_only_when_recorded(tmp_path: Path) -> None:
    out = write_run(run([req("a", 0, 8, 2)]), tmp_path / "r", plots=False)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "requests.parquet", "steps.parquet", "summary.json"]


def test_load_run_names_a_folder_that_is_not_a_run(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not a run folder"):
        load_run(tmp_path)


def test_rare_collections_raises_the_young_threshold_only_while_it_runs() -> None:
    before = gc.get_threshold()
    with pytest.raises(RuntimeError), rare_collections(12_345):
        assert gc.get_threshold() == (12_345, *before[1:])
        raise RuntimeError("a run that fails still restores it")
    assert gc.get_threshold() == before
    run(shared_prefix_requests())  # simulate wraps its run in it
    assert gc.get_threshold() == before
