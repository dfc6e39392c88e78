"""kvsim's KV events against vLLM 0.33's own, step by step (`check.compare_events`): vLLM's Scheduler
built with `--kv-events-config` on, its published batches taken in place of the publisher, and
each block hash named by the prefix it ends (the two hash functions differ)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from kvsim.kvcache.events import KVEventLog
from kvsim.sim.conform.check import compare_events
from kvsim.sim.engine.config import ConfigError, SimConfig
from kvsim.sim.engine.cost_model import CostModel
from kvsim.sim.engine.run import simulate
from kvsim.workloads.traces import load_workload
from tests.sim.conform.test_hybrid_conform import _cfg, _turns

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "workloads"
needs_vllm = pytest.mark.needs_vllm


def _storm(n: int | None = None) -> tuple[list, SimConfig]:
    """Shared system prompts in 31 usable blocks: every request evicts (conform's eviction storm)."""
    wl = list(load_workload(GOLDEN / "shared-prefix.jsonl"))[:n]
    cfg = SimConfig(block_size=16, step_time=0.05, closed_loop_sessions=False, num_gpu_blocks=32,
                    max_num_batched_tokens=256).validate()
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
    cfg = _cfg("gpt-oss-20b", blocks, 0, step_time=0.05, closed_loop_sessions=False, max_num_batched_tokens=512)
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
