"""kvsim's default scheduler mode is `vllm serve`'s: async scheduling.

vLLM 0.33.0, vllm/config/vllm.py `VllmConfig.__post_init__`: `SchedulerConfig.async_scheduling`
defaults to None (vllm/config/scheduler.py), and None resolves to True unless the model is a pooling
one, the executor cannot overlap batches (uni and mp can), pipeline parallelism is on or a
speculative method the V1 runner cannot overlap is asked for. `SimConfig.async_scheduling=None`
follows it, and keeps vLLM's step-by-step `Scheduler` where kvsim models no async one.
"""

from __future__ import annotations

import json
import tempfile

import pytest
from typer.testing import CliRunner

from kvsim.sim.cli.app import app
from kvsim.sim.engine.config import ConfigError, SimConfig
from kvsim.sim.engine.run import simulate
from kvsim.workloads.default import default_workload

needs_vllm = pytest.mark.needs_vllm  # tests/conftest.py: skipped without vLLM, failed in CI
runner = CliRunner()


def test_none_resolves_to_async_as_vllm_serve_does():
    assert SimConfig().async_scheduling is None
    assert SimConfig().runs_async is True
    # a KV connector does not turn it off: offloading's, and a lone NIXL side's (P/D disaggregation)
    assert SimConfig(kv_offloading_size=1.0).runs_async is True
    assert SimConfig(kv_transfer_role="decode").runs_async is True
    assert SimConfig(prefill_replicas=1, decode_replicas=1).runs_async is True  # a P/D cluster's replicas too
    assert SimConfig(async_scheduling=False).runs_async is False
    assert SimConfig(async_scheduling=True).runs_async is True


@pytest.mark.parametrize("changes", [
    {"vllm_version": "0.30"},  # another release: its default is not modelled, its sync scheduler is
    {"preemption": "swap", "num_cpu_blocks": 64},  # vLLM v0's swap
    {"parallel_sampling": "fork"},  # vLLM v0's forked samples
    {"num_lookahead_tokens": 2},  # lookahead slots: kvsim models them under sync only
])
def test_none_keeps_sync_where_kvsim_models_only_sync(changes):
    cfg = SimConfig(**changes).validate()
    assert cfg.async_scheduling is None and cfg.runs_async is False


@pytest.mark.parametrize("value", ["yes", 1, 0])
def test_the_mode_is_a_flag_or_none(value):
    with pytest.raises(ConfigError, match=f"^async_scheduling must be true, false or none \\(as vLLM decides\\), "
                                          f"got {value!r}$"):
        SimConfig(async_scheduling=value).validate()


def test_asking_async_where_kvsim_models_only_sync_is_refused():
    with pytest.raises(ConfigError, match="async_scheduling needs preemption='recompute'"):
        SimConfig(async_scheduling=True, preemption="swap", num_cpu_blocks=64).validate()


def test_the_default_run_is_the_async_run():
    wl = default_workload()
    plain = simulate(wl, SimConfig(num_gpu_blocks=512)).summary
    assert plain == simulate(wl, SimConfig(num_gpu_blocks=512, async_scheduling=True)).summary
    sync = simulate(wl, SimConfig(num_gpu_blocks=512, async_scheduling=False)).summary
    # async: an arrival during a busy step runs a step later, a finished request holds its blocks
    # a step longer (tests/sim/engine/test_async_scheduling.py pins the rules against vLLM)
    assert (plain["steps"], plain["evictions"], sync["steps"], sync["evictions"]) == (9417, 5486, 9414, 5477)


def test_the_cli_names_the_mode_and_takes_either_flag(tmp_path):
    heads = {}
    for flag in ("", "--async-scheduling", "--no-async-scheduling"):
        out = tmp_path / (flag or "default")
        r = runner.invoke(app, ["run", "--no-plots", "-o", str(out), *([flag] if flag else [])])
        assert r.exit_code == 0, r.output
        heads[flag] = r.stdout.splitlines()[0].rsplit(", ", 1)[1]
        summary = json.loads((out / "summary.json").read_text())
        heads[flag] += f" {summary['steps']}"
    assert heads == {"": "async scheduling 9417", "--async-scheduling": "async scheduling 9417",
                     "--no-async-scheduling": "sync scheduling 9414"}
    # the run folder keeps what was asked (None: vllm serve's default), which resolves the same
    assert json.loads((tmp_path / "default/config.json").read_text())["async_scheduling"] is None


@needs_vllm
def test_vllms_own_config_resolves_none_to_async_for_the_conformance_stand_in():
    """`kvsim conform` gives vLLM's SchedulerConfig async_scheduling=None where kvsim runs async
    (sim.conform.check.vllm_async), and vLLM's VllmConfig resolves it: AsyncScheduler, two batches."""
    from vllm.config import SchedulerConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from kvsim.sim.conform.check import vllm_async
    from kvsim.sim.conform.vllm_scheduler import _build_scheduler
    from kvsim.sim.conform.vllm_setup import stand_in_config

    with tempfile.TemporaryDirectory() as tmp:
        config = stand_in_config(tmp, max_model_len=4096, cache={"block_size": 16},
                                 scheduler=SchedulerConfig(max_model_len=4096, is_encoder_decoder=False))
        assert (config.scheduler_config.async_scheduling, config.max_concurrent_batches) == (True, 2)
    assert (vllm_async(SimConfig()), vllm_async(SimConfig(async_scheduling=True))) == (None, True)
    assert vllm_async(SimConfig(kv_transfer_role="decode")) is None  # a NIXL side: vLLM resolves it too
    assert vllm_async(SimConfig(num_lookahead_tokens=2)) is False  # kvsim's sync, asked of vLLM by name
    with tempfile.TemporaryDirectory() as tmp:
        sched, _, queue = _build_scheduler(
            tmp, block_size=16, num_gpu_blocks=64, max_model_len=4096, max_num_batched_tokens=2048,
            max_num_seqs=16, enable_chunked_prefill=True, enable_prefix_caching=True,
            long_prefill_token_threshold=0, watermark=0.0, scheduling="fcfs", async_scheduling=None)
        assert type(sched) is AsyncScheduler and queue == 2


@needs_vllm
def test_kvsim_conform_runs_both_sides_async_by_default(tmp_path):
    r = runner.invoke(app, ["conform", "--mode", "scheduler"])
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines()[0].endswith("the cost model's clock, async scheduling")
    assert "scheduler 300 requests, 0 differ" in r.stdout
