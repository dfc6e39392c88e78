"""`kvsim conform --random`: seeded random workloads and configurations against vLLM 0.33."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvsim.sim.cli.app import app
from kvsim.sim.conform import vllm_setup
from kvsim.sim.conform.random_cases import HYBRID_MODELS, KINDS, random_case

needs_vllm = pytest.mark.needs_vllm  # tests/conftest.py: skipped without vLLM, failed in CI


def test_a_seed_always_gives_the_same_case():
    a, b = random_case(5), random_case(5)
    assert a.cfg == b.cfg and [r.id for r in a.requests] == [r.id for r in b.requests]
    assert a.describe() == ("seed 5: unique, 40 requests, cost clock, block 16, 43 blocks, budget 64/4, long-prefill 32, "
                            "async, max-model-len 643, offloading 0.390625 GiB (1 block a chunk, arc, threshold 0, "
                            "decode chunks too), 22 with n > 1")


def test_every_request_fits_and_the_seeds_cover_the_knobs():
    cases = [random_case(seed) for seed in range(60)]
    for c in cases:
        longest = max(-(-(r.prompt_len + max(r.output_len, 1)) // c.cfg.block_size) for r in c.requests)
        assert longest + 2 <= c.cfg.num_gpu_blocks, c.describe()
    cfgs = [c.cfg for c in cases]
    assert {c.kind for c in cases} == set(KINDS)
    assert sum(c.kv_offloading_size is not None for c in cfgs) == 17
    assert sum(c.async_scheduling for c in cfgs) == 22
    assert sum(not c.enable_chunked_prefill for c in cfgs) == 12
    assert sum(c.scheduling == "priority" for c in cfgs) == 11
    assert sum(not c.enable_prefix_caching for c in cfgs) == 9
    assert sum(c.sliding_window is not None for c in cfgs) == 10
    assert sum(c.sliding_window is not None and c.async_scheduling for c in cfgs) == 1  # seed 18
    assert sum(c.max_model_len is not None for c in cfgs) == 15
    assert sum(any(r.n > 1 for r in c.requests) for c in cases) == 11
    assert sum(c.max_num_active_seqs is not None for c in cfgs) == 10
    assert sum(c.long_prefill_token_threshold_adaptive for c in cfgs) == 11
    assert sum(not c.scheduler_reserve_full_isl for c in cfgs) == 10
    assert sum(c.prefill_schedule_interval > 1 for c in cfgs) == 8
    assert sum(c.max_num_scheduled_tokens is not None for c in cfgs) == 12
    assert sum(c.step_time is None and c.closed_loop_sessions for c in cfgs) == 43  # the cost clock
    assert sum(c.step_time is None and c.kv_offloading_size is not None for c in cfgs) == 13
    assert sum(c.async_scheduling and c.kv_offloading_size is not None for c in cfgs) == 11
    assert sum(c.async_scheduling and c.model in HYBRID_MODELS for c in cfgs) == 5  # hybrid groups under async
    assert sum(c.max_num_scheduled_tokens is not None and c.max_num_scheduled_tokens < c.batch_limits()[1]
               for c in cfgs) == 2


def test_random_takes_no_workload_and_two_integers():
    r = CliRunner().invoke(app, ["conform", "--random", "a:b"])
    assert (r.exit_code, r.output) == (2, "error: --random takes START:STOP (two integers), got 'a:b'\n")
    r = CliRunner().invoke(app, ["conform", "--random", "4:4"])
    assert (r.exit_code, r.output) == (2, "error: --random 4:4: no seeds in that range\n")
    r = CliRunner().invoke(app, ["conform", "w.jsonl", "--random", "3"])
    assert (r.exit_code, r.output) == (2, "error: --random makes its own workloads: give no workload file\n")


@needs_vllm
def test_random_cases_match_vllm():
    # seeds 20-29 draw every knob: 1 offloading (async), 1 windowed, 2 priority, 5 async, 4 max_model_len,
    # 2 without chunking, 1 without caching, 1 with parallel sampling, 2 with max_num_active_seqs,
    # 2 adaptive long-prefill caps, 1 without the full-isl reserve, 1 with a prefill cadence,
    # 3 with max_num_scheduled_tokens (one with an adaptive cap); 6 on the cost clock (2 of them async);
    # 1 in hybrid groups under async (23: llama-4-scout)
    r = CliRunner().invoke(app, ["conform", "--random", "20:30"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert len(lines) == 11 and all(line.endswith(": identical") for line in lines[:10])
    assert lines[-1] == "10 cases, 0 differ"


def test_a_differing_seed_is_named_with_the_command_that_reruns_it(monkeypatch: pytest.MonkeyPatch):
    from kvsim.sim.conform import check

    def fake(requests, cfg, mode, max_running):
        n = len(requests)
        return [check.Diff("scheduler", n, 1 if n == 20 else 0, ("r", "finish_step", 5, 6) if n == 20 else None)]

    monkeypatch.setattr(vllm_setup, "vllm_available", lambda: None)
    monkeypatch.setattr(vllm_setup, "vllm_version", lambda: "0.33.0")
    monkeypatch.setattr(check, "conform", fake)
    r = CliRunner().invoke(app, ["conform", "--random", "1:3", "--mode", "scheduler"])
    assert r.exit_code == 1
    assert r.output.splitlines() == [
        "seed 1: multi-turn, 80 requests, grid 0.05 s, block 16, 143 blocks, budget 2048/64, watermark 0.05, long-prefill 200, "
        "adaptive, prefill every 8: identical",
        # a model mixing layer kinds, its seven groups' blocks in one pool (61 x 7)
        "seed 2: shared-prefix, 20 requests, grid 0.05 s, block 32, 427 blocks, budget 1553/4, watermark 0.05, chunking off, "
        "gemma-3-27b (hybrid groups): scheduler 20 requests, 1 differ; first: request 'r' finish_step: kvsim 5, vLLM 6",
        "2 cases, 1 differ",
        "  rerun: kvsim conform --random 2:3 --mode scheduler",
    ]


@needs_vllm
def test_max_model_len_cuts_answers_on_both_sides_and_too_long_prompts_are_named():
    wl = str(Path(__file__).resolve().parents[2] / "golden" / "workloads" / "multi-turn.jsonl")
    args = ["conform", wl, "--mode", "scheduler", "--num-gpu-blocks", "60", "--max-num-batched-tokens", "256"]
    r = CliRunner().invoke(app, [*args, "--max-model-len", "480"])  # 451-token prompts, 509-token requests
    assert r.exit_code == 0 and r.stdout.splitlines()[1:] == ["scheduler 120 requests, 0 differ", "identical"]
    r = CliRunner().invoke(app, [*args, "--max-model-len", "300"])
    assert r.exit_code == 2 and r.output.endswith(
        "error: 12 requests leave no token under max_model_len 300 (first: 'mt-1-3', a 341-token prompt); "
        "vLLM refuses them before it schedules: give a larger --max-model-len or leave them out\n")
