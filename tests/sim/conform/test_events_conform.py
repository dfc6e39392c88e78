"""kvsim's KV events against vLLM 0.33's own, step by step (`check.compare_events`): vLLM's Scheduler
built with `--kv-events-config` on, its published batches taken in place of the publisher, and
each block hash named by the prefix it ends (the two hash functions differ)."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvsim.kvcache.events import HostEventLog, KVEventLog
from kvsim.sim.cli.app import app
from kvsim.sim.conform.check import _canonical, compare_events
from kvsim.sim.conform.random_cases import random_case
from kvsim.sim.engine.config import ConfigError, SimConfig
from kvsim.sim.engine.cost_model import CostModel
from kvsim.sim.engine.offload_connector import OffloadConnector
from kvsim.sim.engine.run import simulate
from kvsim.workloads.jsonl import write_jsonl
from kvsim.workloads.request import make_request
from kvsim.workloads.traces import load_workload
from tests.sim.conform.test_conform_offload import LINK, _shared_prefix_workload, _toks
from tests.sim.conform.test_conform_offload import _cfg as _offload_cfg
from tests.sim.conform.test_hybrid_conform import _cfg, _turns

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "workloads"
needs_vllm = pytest.mark.needs_vllm


def _storm(n: int | None = None) -> tuple[list, SimConfig]:
    """Shared system prompts in 31 usable blocks: every request evicts (conform's eviction storm).
    Sync: the async case replaces it."""
    wl = list(load_workload(GOLDEN / "shared-prefix.jsonl"))[:n]
    cfg = SimConfig(block_size=16, step_time=0.05, closed_loop_sessions=False, num_gpu_blocks=32,
                    max_num_batched_tokens=256, async_scheduling=False).validate()
    return wl, cfg


def _kinds(requests: list, cfg: SimConfig) -> Counter:
    res = simulate(requests, cfg.replace(kv_events=True))
    return Counter((type(e).__name__, getattr(e, "group_idx", None)) for b in res.kv_events for e in b.events)


@needs_vllm
def test_full_attention_under_eviction_pressure_matches_vllms_events() -> None:
    wl, cfg = _storm()
    assert _kinds(wl, cfg) == Counter({("BlockRemoved", 0): 1222, ("BlockStored", 0): 395})
    assert compare_events(wl, cfg).format() == "events    527 steps, 0 differ"


@needs_vllm
def test_gpt_oss_window_and_full_groups_match_vllms_events() -> None:
    """Its two groups, tight: the window group's masked calls are BlockStored events with no hash
    (372 of them), as vLLM's `cache_full_blocks` publishes them."""
    blocks = 170 * len(CostModel.from_config(_cfg("gpt-oss-20b", 500, 0)).layout.groups)
    cfg = _cfg("gpt-oss-20b", blocks, 0, step_time=0.05, closed_loop_sessions=False,
               max_num_batched_tokens=512).replace(async_scheduling=False)
    reqs = _turns()
    res = simulate(reqs, cfg.replace(kv_events=True))
    stored = [e for b in res.kv_events for e in b.events if type(e).__name__ == "BlockStored"]
    assert (len(stored), sum(not e.block_hashes for e in stored)) == (866, 372)
    assert compare_events(reqs, cfg).format() == "events    480 steps, 0 differ"


@needs_vllm
def test_a_wrong_parent_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: events that forget their parent differ from vLLM's at the first step that
    caches a block after a cached one."""
    wl, cfg = _storm(20)
    stored = KVEventLog.stored

    def orphan(self, *args, **kw):
        stored(self, *args, **kw)
        e = self.queue[-1]
        self.queue[-1] = type(e)(e.block_hashes, None, e.token_ids, e.block_size, e.medium, e.group_idx)

    monkeypatch.setattr(KVEventLog, "stored", orphan)
    d = compare_events(wl, cfg)
    assert not d.ok and d.differing > 0
    step, where, ours, theirs = d.first
    assert ours["parent_block_hash"] is None and theirs["parent_block_hash"].endswith("tokens>")


def test_events_are_compared_on_the_step_grid_only() -> None:
    wl, cfg = _storm(5)
    with pytest.raises(ConfigError, match="step grid"):
        compare_events(wl, cfg.replace(step_time=None))


def _offload_cases() -> dict[str, tuple[list, SimConfig]]:
    """Workloads of test_conform_offload.py on the step grid, sync: a 3-chunk tier that evicts and
    fails stores, recompute preemptions under pressure, two blocks a chunk with pending chunks, and
    a finished request's offer retried in a step that schedules nothing."""
    rng = random.Random(1)
    heads = [_toks(10_000 * (i + 1), 16 * n) for i, n in enumerate((2, 4, 2, 1))]
    small = _offload_cfg(3, 1.0)
    return {
        "tier-too-small": ([make_request(f"r{i}", i * 2 * small.step_time, rng.choice(heads) + _toks(100_000 * (i + 1),
                                         rng.randint(0, 20)), rng.randint(1, 6)) for i in range(24)], small),
        "preemptions": (_shared_prefix_workload(2, out=(20, 80), gap=5e-5),
                        _offload_cfg(8, 1.4, num_gpu_blocks=20, max_num_batched_tokens=128)),
        "two-blocks-a-chunk": (_shared_prefix_workload(25, gap=2e-5, out=(1, 4), blocks=(3, 9)),
                               _offload_cfg(16, LINK / 1e-5, offload_blocks_per_chunk=2, num_gpu_blocks=20,
                                            max_num_batched_tokens=128)),
        "empty-steps": (_shared_prefix_workload(125, gap=3e-5, out=(1, 3)),
                        _offload_cfg(6, LINK / 1e-5, offload_prompt_only=False, num_gpu_blocks=20,
                                     max_num_batched_tokens=128)),
    }


def _by_medium(requests: list, cfg: SimConfig) -> Counter:
    res = simulate(requests, cfg.replace(kv_events=True))
    return Counter((type(e).__name__, e.medium) for b in res.kv_events for e in b.events)


@needs_vllm
def test_async_scheduling_matches_vllms_events() -> None:
    """vLLM's AsyncScheduler behind EngineCore's two-deep batch queue: schedule k + 1 comes before
    update_from_output of k, so a batch's events include the next schedule's evictions, in both."""
    wl, cfg = _storm()
    assert compare_events(wl, cfg.replace(async_scheduling=True)).format() == "events    353 steps, 0 differ"


@needs_vllm
@pytest.mark.parametrize(("name", "steps", "kinds"), [
    ("tier-too-small", 33, {("BlockStored", "GPU"): 28, ("BlockRemoved", "GPU"): 42, ("BlockStored", "CPU"): 16,
                            ("BlockRemoved", "CPU"): 9}),
    ("preemptions", 266, {("BlockStored", "GPU"): 188, ("BlockRemoved", "GPU"): 237, ("BlockStored", "CPU"): 102,
                          ("BlockRemoved", "CPU"): 41}),
    ("two-blocks-a-chunk", 47, {("BlockStored", "GPU"): 53, ("BlockRemoved", "GPU"): 160, ("BlockStored", "CPU"): 67,
                                ("BlockRemoved", "CPU"): 34}),
    ("empty-steps", 45, {("BlockStored", "GPU"): 36, ("BlockRemoved", "GPU"): 70, ("BlockStored", "CPU"): 47,
                         ("BlockRemoved", "CPU"): 17}),
])
def test_offloading_the_cpu_tiers_events_match_vllms(name: str, steps: int, kinds: dict) -> None:
    """vLLM's Scheduler with its OffloadingConnector and `--kv-events-config` on publishes the CPU
    tier's events after the GPU pool's in each batch (vllm/v1/core/sched/scheduler.py
    `update_from_output`: `kv_cache_manager.take_events()`, then `connector.take_events()`), a
    removal where `CPUOffloadingManager.prepare_store` evicts (the schedule) and a store where
    `complete_store` is called (the step's output, `_update_connector_output`), empty steps too."""
    requests, cfg = _offload_cases()[name]
    assert _by_medium(requests, cfg) == Counter(kinds)
    assert compare_events(requests, cfg).format() == f"events    {steps:,} steps, 0 differ"


@needs_vllm
@pytest.mark.parametrize(("name", "steps"), [("tier-too-small", 34), ("preemptions", 206), ("two-blocks-a-chunk", 41),
                                             ("empty-steps", 54)])
def test_offloading_under_async_scheduling_matches_vllms_events(name: str, steps: int) -> None:
    """As vLLM serves offloading by default (async scheduling): the connector's events are taken at
    each batch's `update_from_output`, after the next batch's schedule."""
    requests, cfg = _offload_cases()[name]
    assert compare_events(requests, cfg.replace(async_scheduling=True)).format() == f"events    {steps:,} steps, 0 differ"


@needs_vllm
@pytest.mark.parametrize(("seed", "steps", "asynchronous"), [
    (115, 135, False), (238, 364, False), (281, 69, False), (548, 49, False), (22, 166, True), (554, 58, True)])
def test_offloading_random_cases_match_vllms_events(seed: int, steps: int, asynchronous: bool) -> None:
    """`kvsim conform --random`'s offloading cases that run on the step grid with prefix caching and
    one sample a request (seeds 0-599: 49 such, 23 sync and 26 async, all 0 differ); quick ones with
    CPU-tier events."""
    case = random_case(seed)
    cfg = case.cfg
    assert (cfg.kv_offloading_size is not None, cfg.step_time is not None, cfg.async_scheduling) == \
        (True, True, asynchronous)
    assert _by_medium(case.requests, cfg)[("BlockStored", "CPU")] > 0
    assert compare_events(case.requests, cfg).format() == f"events    {steps:,} steps, 0 differ"


@needs_vllm
@pytest.mark.parametrize(("seed", "steps"), [(71017, 23), (70035, 218)])
def test_priority_scheduling_matches_vllms_events(seed: int, steps: int) -> None:
    """Priority admits out of arrival order; a request's decoded tokens are still its own (their
    stand-ins numbered by arrival, as the driver feeds vLLM `token_ids(request, index)`), so a block
    holding them stores the same tokens and hash as vLLM's. Both seeds differed (7 and 89 steps)
    while kvsim numbered sequences in admission order; the second is gpt-oss-20b's two groups."""
    case = random_case(seed)
    assert case.cfg.scheduling == "priority" and case.cfg.step_time is not None
    assert compare_events(case.requests, case.cfg).format() == f"events    {steps:,} steps, 0 differ"


@needs_vllm
def test_missing_or_misordered_cpu_events_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative controls: no host-tier events, or a removal's keys out of eviction order, differ."""
    requests, cfg = _offload_cases()["tier-too-small"]
    with monkeypatch.context() as m:
        m.setattr(OffloadConnector, "take_events", lambda self: [])
        d = compare_events(requests, cfg)
        assert not d.ok and d.first[2] is None and d.first[3]["medium"] == "CPU"
    removed = HostEventLog.removed
    monkeypatch.setattr(HostEventLog, "removed", lambda self, keys: removed(self, list(reversed(keys))))
    d = compare_events(requests, cfg)
    assert not d.ok and d.first[2]["type"] == d.first[3]["type"] == "BlockRemoved"


def test_a_run_of_cpu_stores_compares_as_a_set_but_nothing_else_does() -> None:
    """vLLM completes a store job's chunks in a set's order (offloading/scheduler.py `_build_store_jobs`:
    `keys=set(keys_to_store)`), which follows PYTHONHASHSEED: such a run is sorted; GPU events and
    removals keep their order."""
    def ev(kind: str, medium: str, h: int) -> dict:
        return {"type": kind, "block_hashes": [h], "medium": medium}

    a = [ev("BlockStored", "GPU", 2), ev("BlockStored", "GPU", 1), ev("BlockStored", "CPU", 5),
         ev("BlockStored", "CPU", 3), ev("BlockRemoved", "CPU", 9), ev("BlockStored", "CPU", 4)]
    assert _canonical(a) == [a[0], a[1], a[3], a[2], a[4], a[5]]
    assert _canonical([a[1], a[0]]) == [a[1], a[0]]
    assert _canonical([a[5], a[4]]) == [a[5], a[4]]


def test_a_file_tier_with_kv_events_is_refused() -> None:
    _, cfg = _offload_cases()["empty-steps"]
    with pytest.raises(ConfigError, match="kv_events: the host tier's KV events with a file tier"):
        simulate([make_request("a", 0.0, _toks(0, 32), 1)], cfg.replace(kv_events=True, offload_fs=True))


@needs_vllm
def test_kvsim_conform_mode_events_compares_the_streams_with_offloading(tmp_path: Path) -> None:
    requests, cfg = _offload_cases()["tier-too-small"]
    path = tmp_path / "w.jsonl"
    write_jsonl(requests, path)
    r = CliRunner().invoke(app, ["conform", str(path), "--mode", "events", "--num-gpu-blocks", "9",
                                 "--max-num-batched-tokens", "256", "--max-num-seqs", "8",
                                 "--step-time", repr(cfg.step_time), "--kv-offloading-size", repr(cfg.kv_offloading_size),
                                 "--no-async-scheduling"])
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines()[1:] == ["events    33 steps, 0 differ", "identical"]
    r = CliRunner().invoke(app, ["conform", str(path), "--mode", "events", "--kv-offloading-size", "0.03125"])
    # refused in one line before anything runs (no header, nothing simulated)
    assert (r.exit_code, r.stdout) == (2, "")
    assert r.stderr == "error: KV events are compared on the step grid (--step-time), with prefix caching on\n"


def test_a_prefix_is_named_by_its_length_and_a_chained_digest() -> None:
    """`prefix_names`: the k-th name is the first k + 1 blocks' (length, 16-byte digest); equal
    prefixes share a name, and a change in one block renames every prefix from it on. Each name
    is a fixed size, so naming a 12k-token prompt's prefixes takes linear memory (they were once
    tuples of every prefix's tokens: 8 GB for 30 Mooncake requests in events mode)."""
    from kvsim.sim.conform.vllm_setup import prefix_names

    a = list(range(1000, 1050))  # 3 full blocks of 16 and 2 tokens over
    b = a[:32] + [7] * 18  # the same first two blocks, another third
    c = [999] + a[1:]  # another first token
    na, nb, nc = (prefix_names(t, 16) for t in (a, b, c))
    assert [n for n, _ in na] == [16, 32, 48]
    assert all(isinstance(d, bytes) and len(d) == 16 for _, d in na)
    assert na[:2] == nb[:2] and na[2] != nb[2]
    assert all(x != y for x, y in zip(na, nc, strict=True))
    assert prefix_names(a[:47], 16) == na[:2] and prefix_names(a[:15], 16) == []
    assert len({d for _, d in prefix_names(list(range(12_000)), 16)}) == 750
