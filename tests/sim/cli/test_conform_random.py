"""`kvsim conform --random`: a case kvsim refuses is skipped; one that fails in vLLM, in a vLLM
driver (`sim.conform.vllm_*`) or in kvsim fails its seed, with a one-line reason and a rerun line."""

from __future__ import annotations

import types

import pytest
from typer.testing import CliRunner

from kvsim.sim.cli.app import app
from kvsim.sim.conform import check, random_cases, vllm_setup
from kvsim.sim.engine.config import ConfigError, SimConfig
from kvsim.workloads.request import make_request

FIT = "3 requests do not fit (first: 'r0', prompt_exceeds_cache); vLLM would stall on them"


def _raise(error: Exception) -> None:
    raise error


def _raised_in(module: str):
    """`_raise` as if defined in `module`: its frame's module name is `module`."""
    return types.FunctionType(_raise.__code__, {"__name__": module})


def _case(seed: int, **kw) -> random_cases.Case:
    reqs = [make_request(f"r{i}", 0.1 * i, range(1000 * i, 1000 * i + 40), 4) for i in range(3)]
    cfg = SimConfig(**{"block_size": 16, "step_time": 0.05, "closed_loop_sessions": False, "num_gpu_blocks": 40,
                       "max_num_batched_tokens": 256, **kw}).validate()
    return random_cases.Case(seed, "unique", reqs, cfg, 1)


# what check.conform does with each seed's case (seed 17: random_case itself refuses)
OUTCOMES = {
    10: lambda reqs: [check.Diff("scheduler", 3, 0)],
    11: lambda reqs: [check.Diff("scheduler", 3, 1, ("r1", "finish_step", 5, 6))],
    12: lambda reqs: vllm_setup.check_ids([*reqs, reqs[0]]),  # a driver's ValueError
    13: lambda reqs: _raised_in("vllm.config.scheduler")(
        ValueError("1 validation error for SchedulerConfig\n  Value error, bad budget")),
    14: lambda reqs: _raise(ConfigError(FIT)),  # kvsim refuses it before vLLM runs
    15: lambda reqs: _raise(RuntimeError("kvsim's tier has 3 chunks, conform computed 4")),
    16: lambda reqs: _raised_in("kvsim.sim.conform.vllm_scheduler")(ConfigError("raised in a driver")),
}


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> dict[int, random_cases.Case]:
    """vLLM 'installed'; each seed's case and check.conform's outcome from OUTCOMES."""
    cases = {seed: _case(seed) for seed in OUTCOMES}

    def random_case(seed: int, pd: bool = False) -> random_cases.Case:
        if seed not in cases:
            raise ConfigError(f"max_num_batched_tokens (8) must be >= max_num_seqs (16), seed {seed}")
        return cases[seed]

    def conform(requests, cfg, mode, max_running):
        (seed,) = (s for s, c in cases.items() if c.requests is requests)
        return OUTCOMES[seed](requests)

    monkeypatch.setattr(vllm_setup, "vllm_available", lambda: None)
    monkeypatch.setattr(vllm_setup, "vllm_version", lambda: "0.33.0")
    monkeypatch.setattr(random_cases, "random_case", random_case)
    monkeypatch.setattr(check, "conform", conform)
    return cases


def test_failures_in_vllm_and_kvsim_fail_their_seeds_and_refusals_are_skipped(fake: dict):
    r = CliRunner().invoke(app, ["conform", "--random", "10:18", "--mode", "scheduler"])
    assert r.exit_code == 1
    head = {seed: case.describe() for seed, case in fake.items()}
    assert r.output.splitlines() == [
        f"{head[10]}: identical",
        f"{head[11]}: scheduler 3 requests, 1 differ; first: request 'r1' finish_step: kvsim 5, vLLM 6",
        f"{head[12]}: failed in vLLM: ValueError: request id 'r0' appears twice; vLLM needs unique ids",
        f"{head[13]}: failed in vLLM: ValueError: 1 validation error for SchedulerConfig Value error, bad budget",
        f"seed 14: skipped ({FIT})",
        f"{head[15]}: failed in kvsim: RuntimeError: kvsim's tier has 3 chunks, conform computed 4",
        f"{head[16]}: failed in vLLM: ConfigError: raised in a driver",
        "seed 17: skipped (max_num_batched_tokens (8) must be >= max_num_seqs (16), seed 17)",
        "8 cases, 1 differ, 4 failed, 2 skipped",
        *(f"  rerun: kvsim conform --random {s}:{s + 1} --mode scheduler" for s in (11, 12, 13, 15, 16)),
    ]


def test_skipped_cases_alone_exit_0(fake: dict):  # noqa: ARG001
    r = CliRunner().invoke(app, ["conform", "--random", "14:15"])
    assert (r.exit_code, r.output.splitlines()) == (0, [f"seed 14: skipped ({FIT})", "1 cases, 0 differ, 1 skipped"])


def test_a_failure_alone_exits_1(fake: dict):
    r = CliRunner().invoke(app, ["conform", "--random", "12:13", "--mode", "both"])
    assert r.exit_code == 1
    assert r.output.splitlines() == [
        f"{fake[12].describe()}: failed in vLLM: ValueError: request id 'r0' appears twice; vLLM needs unique ids",
        "1 cases, 0 differ, 1 failed",
        "  rerun: kvsim conform --random 12:13 --mode both",
    ]


@pytest.mark.needs_vllm
def test_a_config_vllm_refuses_fails_its_seed(monkeypatch: pytest.MonkeyPatch):
    # kvsim takes a long-prefill cap above max_model_len; vLLM's SchedulerConfig refuses it
    # (random_cases never draws one): once skipped as a ValueError, now a failure
    case = _case(3, max_model_len=100, long_prefill_token_threshold=200)
    monkeypatch.setattr(random_cases, "random_case", lambda seed, pd=False: case)
    r = CliRunner().invoke(app, ["conform", "--random", "3:4", "--mode", "scheduler"])
    assert r.exit_code == 1
    lines = r.output.splitlines()
    assert lines[0].startswith(
        f"{case.describe()}: failed in vLLM: ValidationError: 1 validation error for SchedulerConfig Value error, "
        "long_prefill_token_threshold (200) cannot be greater than the max_model_len (100).")
    assert lines[1:] == ["1 cases, 0 differ, 1 failed", "  rerun: kvsim conform --random 3:4 --mode scheduler"]
