"""`async_scheduling`: vLLM 0.33's AsyncScheduler behind EngineCore's two-deep batch queue.

The engine-level cases pin the one-step-earlier scheduling and the config
checks without vLLM; the conform cases run kvsim and the real vLLM 0.33
AsyncScheduler (`sim.conform.vllm_scheduler.run_scheduler(async_scheduling=True)`)
side by side and need every request's steps to agree (skipped, with the
reason, where vLLM is not installed: `bash .ci/install_vllm_cpu.sh`).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvsim.sim.cli.app import app
from kvsim.sim.conform.check import conform
from kvsim.sim.engine.config import ConfigError, SimConfig
from kvsim.workloads.default import default_workload
from kvsim.workloads.jsonl import write_jsonl
from kvsim.workloads.request import make_request
from kvsim.workloads.traces import load_workload
from tests.sim.engine.engine_fixtures import req, run

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "workloads"
needs_vllm = pytest.mark.needs_vllm  # tests/conftest.py: skipped without vLLM, failed in CI
STEP_COLUMNS = ["first_scheduled_step", "first_token_step", "finish_step"]


def _steps(async_scheduling: bool, **kw) -> list[list[int]]:
    res = run([req("a", 0, 4, 6), req("b", 0.5, 4, 2)], step_time=1.0, closed_loop_sessions=False,
              async_scheduling=async_scheduling, **kw)
    return res.requests[STEP_COLUMNS].astype(int).values.tolist()


def test_the_next_batch_is_scheduled_before_the_previous_output_so_arrivals_wait_a_step_longer():
    # b arrives at 0.5: sync sees it at step 1; async schedules step 1 at time 0 (while
    # step 0 runs), so b first gets step 2; a alone runs the same steps either way
    assert _steps(False) == [[0, 0, 5], [1, 1, 2]]
    assert _steps(True) == [[0, 0, 5], [2, 2, 3]]
    assert _steps(True, debug_invariants=True) == [[0, 0, 5], [2, 2, 3]]


def test_with_the_cost_model_a_batch_starts_when_the_previous_one_ends():
    res = run([req("a", 0, 4, 6), req("b", 0.5, 4, 2)], async_scheduling=True, debug_invariants=True)
    assert res.requests[["first_scheduled", "first_token", "finish"]].values.tolist() == [
        [0.0, 1.0, 6.0], [2.0, 3.0, 4.0]]
    assert res.steps["time"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert res.steps["scheduled_seqs"].tolist() == [1, 1, 2, 2, 1, 1]


def test_a_full_cache_preempts_and_every_request_still_finishes():
    res = run([req(f"r{i}", i * 0.25, 10, 12) for i in range(8)], num_gpu_blocks=12, step_time=1.0,
              closed_loop_sessions=False, async_scheduling=True, debug_invariants=True)
    rq = res.requests
    assert (rq["status"] == "finished").all() and (rq["output_tokens"] == 12).all()
    assert rq["preemptions"].sum() > 0 and res.steps["preempt_recompute"].sum() > 0


@pytest.mark.parametrize(("change", "message"), [
    ({"preemption": "swap", "num_cpu_blocks": 8}, "needs preemption='recompute'"),
    ({"num_lookahead_tokens": 2}, "lookahead"),
])
def test_what_async_scheduling_does_not_model_is_a_config_error(change: dict, message: str):
    with pytest.raises(ConfigError, match=message):
        SimConfig(async_scheduling=True, **change).validate()


def test_parallel_sampling_fans_out_and_v0_forks_are_refused_by_name():
    res = run([req("a", 0, 4, 2, n=2)], async_scheduling=True)  # two requests 0_a, 1_a (vLLM V1)
    assert (res.requests["status"].tolist(), res.requests["output_tokens"].tolist()) == (["finished"], [4])
    with pytest.raises(ConfigError, match="request 'a': n=2; async scheduling does not fork"):
        run([req("a", 0, 4, 2, n=2)], async_scheduling=True, parallel_sampling="fork")


# ------------------------------------------------------------------ against vLLM
def _fits(requests: list, blocks: int, block_size: int = 16) -> list:
    """The requests whose whole context fits the usable blocks (vLLM stalls on the others)."""
    return [r for r in requests if r.prompt_len + max(r.output_len, 1) <= (blocks - 1) * block_size]


def _ties() -> list:
    rng = random.Random(5)
    return [make_request(f"r{i}", float(i // 6), range(i * 1000, i * 1000 + rng.randint(5, 120)),
                         rng.randint(1, 30), priority=rng.randint(-1, 1)) for i in range(60)]


CASES = {
    # 138 preemptions in vLLM, each with output in flight (delivered stale)
    "default, 300 blocks": (lambda: list(default_workload(0)), {"num_gpu_blocks": 300}),
    "default, 400 blocks": (lambda: list(default_workload(0)), {"num_gpu_blocks": 400}),
    "default fitting 60 blocks": (lambda: _fits(list(default_workload(0)), 60), {"num_gpu_blocks": 60}),
    "default, watermark and long-prefill cap": (lambda: list(default_workload(0)), {
        "num_gpu_blocks": 300, "max_num_batched_tokens": 1024, "watermark": 0.05,
        "long_prefill_token_threshold": 256}),
    "shared-prefix, eviction storm": (lambda: list(load_workload(GOLDEN / "shared-prefix.jsonl")),
                                      {"num_gpu_blocks": 32, "max_num_batched_tokens": 256}),
    "multi-turn, caching off": (lambda: list(load_workload(GOLDEN / "multi-turn.jsonl")), {
        "num_gpu_blocks": 40, "max_num_batched_tokens": 128, "enable_prefix_caching": False}),
    "multi-turn, chunking off": (lambda: list(load_workload(GOLDEN / "multi-turn.jsonl")), {
        "num_gpu_blocks": 60, "max_num_batched_tokens": 2048, "enable_chunked_prefill": False}),
    "priority with ties": (_ties, {"num_gpu_blocks": 30, "max_num_batched_tokens": 128, "max_num_seqs": 8,
                                   "scheduling": "priority", "step_time": 1.0}),
}


@needs_vllm
@pytest.mark.parametrize("case", CASES)
def test_kvsim_matches_vllm_async_scheduler_request_by_request(case: str):
    make, kw = CASES[case]
    kw = {"step_time": 0.05, **kw}
    cfg = SimConfig(block_size=16, closed_loop_sessions=False, async_scheduling=True, **kw).validate()
    (d,) = conform(make(), cfg, "scheduler")
    assert d.ok, d.format()


def _random_case(seed: int) -> tuple[list, dict]:
    """Small random workloads on tight caches: arrivals on and off the grid, shared prefixes,
    priorities, chunk caps, watermark, chunking or caching off."""
    rng = random.Random(seed)
    n = rng.randint(5, 60)
    nb = rng.choice([12, 16, 20, 30, 40, 60, 100])
    maxlen = (nb - 1) * 16
    budget = rng.choice([32, 64, 128, 256, 512, 2048])
    seqs = min(rng.choice([2, 4, 8, 16, 64]), budget)
    shared = [rng.randint(0, 10**6) for _ in range(3)]
    reqs, t = [], 0.0
    for i in range(n):
        t += rng.choice([0, 0, 0.5, 1.0, rng.random() * 3, 2.0])
        p = rng.randint(1, min(300, maxlen // 2))
        out = rng.randint(1, min(60, maxlen - p))
        base = rng.choice([*shared, None])
        k = 0 if base is None else rng.randint(0, p)
        toks = [*range(base or 0, (base or 0) + k), *range(i * 100000, i * 100000 + p - k)]
        reqs.append(make_request(f"r{i}", round(t, 3), toks, out, priority=rng.randint(-1, 1)))
    kw = {"num_gpu_blocks": nb, "max_num_batched_tokens": budget, "max_num_seqs": seqs, "step_time": 1.0,
          "enable_prefix_caching": rng.random() < 0.8, "scheduling": rng.choice(["fcfs", "fcfs", "priority"]),
          "long_prefill_token_threshold": rng.choice([0, 0, 16, 48]), "watermark": rng.choice([0.0, 0.0, 0.1])}
    if rng.random() < 0.15:
        kw["enable_chunked_prefill"] = False
        kw["max_num_batched_tokens"] = max(budget, maxlen)
    return reqs, kw


@needs_vllm
@pytest.mark.parametrize("seed", [5, 6, 42, 67, 92, 115])
def test_random_tight_caches_match_vllm(seed: int):
    # each of these seeds preempts a request whose last token is in flight: its stale output
    # finishes it in WAITING (counted when the test was written; 360 seeds all matched)
    reqs, kw = _random_case(seed)
    cfg = SimConfig(block_size=16, closed_loop_sessions=False, async_scheduling=True, **kw).validate()
    (d,) = conform(reqs, cfg, "scheduler")
    assert d.ok, d.format()


@needs_vllm
def test_sync_kvsim_against_the_async_vllm_differs():
    # the comparison is not blind: one step of lag shows up
    reqs = list(default_workload(0))[:60]
    sync = SimConfig(block_size=16, step_time=0.05, closed_loop_sessions=False, num_gpu_blocks=300,
                     async_scheduling=False)
    from kvsim.sim.conform.check import SCHEDULER_FIELDS, compare, kvsim_scheduler
    from kvsim.sim.conform.vllm_scheduler import run_scheduler

    theirs = run_scheduler(reqs, block_size=16, num_gpu_blocks=300, max_num_batched_tokens=sync.batch_limits()[0],
                           max_num_seqs=sync.batch_limits()[1], step_time=0.05, async_scheduling=True)
    assert not compare("scheduler", kvsim_scheduler(reqs, sync), theirs, SCHEDULER_FIELDS).ok
    assert compare("scheduler", kvsim_scheduler(reqs, sync.replace(async_scheduling=True)), theirs,
                   SCHEDULER_FIELDS).ok


@needs_vllm
def test_cli_conform_async_prints_identical(tmp_path: Path):
    path = tmp_path / "slice.jsonl"
    write_jsonl(_fits(list(default_workload(0))[:100], 60), path)
    r = CliRunner().invoke(app, ["conform", str(path), "--mode", "scheduler", "--async-scheduling",
                                 "--num-gpu-blocks", "60"])
    assert r.exit_code == 0, r.output
    assert "async scheduling" in r.output and "scheduler 95 requests, 0 differ" in r.output
    assert r.output.rstrip().endswith("identical")


def test_kvsim_run_takes_the_flag(tmp_path: Path):
    wl = tmp_path / "two.jsonl"
    write_jsonl([req("a", 0, 40, 5), req("b", 0.1, 40, 5)], wl)
    out = tmp_path / "r"
    args = ["run", str(wl), "--async-scheduling", "--num-gpu-blocks", "64", "--block-size", "8",
            "--max-model-len", "44", "--record-ops", "--no-plots", "--out", str(out)]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert json.loads((out / "config.json").read_text())["async_scheduling"] is True
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["finished"], summary["output_tokens"]) == (2, 8)  # 40 + 5 capped at 44
    r = CliRunner().invoke(app, ["run", str(wl), "--async-scheduling", "--preemption", "swap",
                                 "--num-cpu-blocks", "8", "--no-plots", "--out", str(tmp_path / "s")])
    assert (r.exit_code, r.output) == (2, "error: async_scheduling needs preemption='recompute' "
                                          "(vLLM V1 has no swap), got 'swap'\n")


@needs_vllm
@pytest.mark.parametrize("seed", [81, 698])
def test_one_groups_sliding_window_matches_vllm_under_async(seed):
    """A sliding window under async output (vLLM 0.33): its blocks go on the processed tokens, computed
    less in flight (vllm/v1/core/kv_cache_manager.py `KVCacheManager.allocate_slots`, its
    `remove_skipped_blocks` call), and its admission cap counts two budgets in flight
    (vllm/config/vllm.py `VllmConfig.max_in_flight_tokens`). Both random cases differ from vLLM
    when either rule is dropped."""
    from kvsim.sim.conform.random_cases import random_case

    case = random_case(seed)
    assert case.cfg.async_scheduling and case.cfg.sliding_window == 500, case.describe()
    diffs = conform(case.requests, case.cfg, "both", max_running=case.max_running)
    assert [d.format() for d in diffs if not d.ok] == [], case.describe()


# Seed 86435 of `kvsim conform --random` (gemma-3-27b in hybrid groups, 994 blocks of 8, caching off,
# priority scheduling, async, 200-token long-prefill chunks): from about step 1,000 on, 1_par-17 and
# two lower-priority prompts take turns being preempted, every batch a prefill chunk, and nothing is
# ever decoded again. vLLM 0.33's own AsyncScheduler cycles the same way (the test below); both
# engines would step forever. The engine stops once LIVELOCK_PREEMPTIONS preemptions come in a row
# with no token decoded and no request finished (here lowered to 300, to keep the test short).
CYCLING_SEED = 86435


def test_a_preemption_cycle_stops_the_engine_with_an_error_naming_its_requests(monkeypatch):
    from kvsim.sim.conform.random_cases import random_case
    from kvsim.sim.engine import loop
    from kvsim.sim.engine.run import simulate

    monkeypatch.setattr(loop, "LIVELOCK_PREEMPTIONS", 300)
    case = random_case(CYCLING_SEED)
    with pytest.raises(loop.Stalled) as e:
        simulate(case.requests, case.cfg)
    assert str(e.value) == (
        "scheduler made no progress: 300 preemptions in a row with no token decoded and no request finished, "
        "up to t=65.000000s (step 1300); requests 1_par-17, 0_par-17 preempt each other in a cycle, as vLLM "
        "0.33's scheduler does on this configuration: give more --num-gpu-blocks or a larger "
        "--max-num-batched-tokens")


@needs_vllm
def test_a_case_both_engines_cycle_on_is_refused_by_conform(monkeypatch):
    """vLLM's driver counts the same preemptions (sim/conform/vllm_scheduler.py `_SchedRun.cycled`,
    from SchedulerOutput.preempted_req_ids): both cycle, so the case is refused, not failed."""
    from kvsim.sim.conform.random_cases import random_case
    from kvsim.sim.engine import loop

    monkeypatch.setattr(loop, "LIVELOCK_PREEMPTIONS", 300)
    case = random_case(CYCLING_SEED)
    with pytest.raises(ConfigError, match=r"^kvsim and vLLM both stall on this case \(kvsim: scheduler made no "
                                          r"progress: 300 preemptions in a row .*; vLLM: vLLM cycled: 300 "
                                          r"preemptions in a row with no token decoded and no request finished"):
        conform(case.requests, case.cfg, "scheduler")
