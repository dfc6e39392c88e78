"""KV offloading in the engine (sim.engine.offload, vLLM 0.33's OffloadingConnector scheduler side):
stores of computed prompt chunks, a later admission's prefix loaded back from the host tier."""

from __future__ import annotations

import numpy as np
import pytest

from sim.engine.config import ConfigError, SimConfig
from sim.engine.run import simulate
from tests.sim.engine.engine_fixtures import FlatCost, req
from workloads.request import Workload

MIB = 1 << 20


class HostLinkCost(FlatCost):
    """Flat 1 s steps; a GPU block is 1 MiB and takes `link_s` seconds each way on the host link."""

    def __init__(self, link_s: float = 0.0):
        super().__init__(1.0)
        self.kv_bytes_per_block = MIB
        self.op_cost_s = {"load": link_s, "store": link_s}


def _run(requests, chunks: int = 16, link_s: float = 0.0, **cfg):
    base = {"block_size": 4, "num_gpu_blocks": 8, "kv_offloading_size": chunks * MIB / (1 << 30)}
    c = SimConfig(**{**base, **cfg})
    return simulate(Workload.from_list(requests, "test"), c, cost_model=HostLinkCost(link_s))


def _evicted_prefix():
    """a's 16-token prompt is stored in the tier; f's 24 tokens then evict a's blocks from the
    GPU; b repeats a's prompt plus 4 tokens."""
    a = np.arange(100, 116)
    return [req("a", 0, a, 2), req("f", 10, 24, 2), req("b", 20, np.concatenate([a, np.arange(500, 504)]), 2)]


def test_a_prefix_evicted_from_the_gpu_is_loaded_back_from_the_tier() -> None:
    res = _run(_evicted_prefix())
    r = res.requests.set_index("id")
    s = res.summary
    assert r["hit_tokens"].tolist() == [0, 0, 0]  # no GPU hit: b's prefix came from the tier
    assert s["offload_hit_tokens"] == 16
    assert s["loaded_blocks"] == 4
    # a's 4 prompt chunks, f's 6, b's own last one (its first 4 were loaded, not offered again)
    assert s["stored_blocks"] == 4 + 6 + 1
    assert (s["stored_bytes"], s["loaded_bytes"]) == (11 * MIB, 4 * MIB)
    assert s["total_hit_rate"] == 16 / (16 + 24 + 20)
    # b's load is applied at once (an empty step polls it), then b prefills its last 4 tokens
    assert r.loc["b", "first_scheduled"] == 20.0 and r.loc["b", "first_token"] == 21.0


def test_a_load_takes_its_blocks_over_the_host_link() -> None:
    """b's 4-block load, planned in the empty step at t=20, takes 4 * 0.5 s: b runs at 22."""
    r = _run(_evicted_prefix(), link_s=0.5).requests.set_index("id")
    assert (r.loc["b", "first_scheduled"], r.loc["b", "first_token"]) == (22.0, 23.0)


def test_a_finished_request_s_store_is_flushed_when_its_blocks_are_reused() -> None:
    """a's stores (planned at step 0, started when step 1 ends at t=2) would take 4 * 5 s, but at
    t=10 f takes a's freed blocks: the worker finishes the store first (vLLM `_build_connector_meta`
    flushes jobs whose blocks are reallocated), so at t=20 b finds a's chunks ready, loads them
    for 4 * 5 s and runs at t=40."""
    res = _run(_evicted_prefix(), link_s=5.0)
    r = res.requests.set_index("id")
    assert (r.loc["b", "first_scheduled"], r.loc["b", "first_token"]) == (40.0, 41.0)
    assert res.summary["offload_hit_tokens"] == 16


def test_a_full_prompt_hit_loads_every_block_and_recomputes_the_last_token() -> None:
    """vLLM's tier lookup may cover the whole prompt (`_lookup_complete_chunks` stops at
    num_tokens, not num_tokens - 1); once loaded, the last token is computed again
    (vllm/v1/core/sched/scheduler.py `_update_waiting_for_remote_kv`)."""
    a = np.arange(100, 116)
    res = _run([req("a", 0, a, 2), req("f", 10, 24, 2), req("b", 20, a.copy(), 2)])
    assert res.summary["offload_hit_tokens"] == 16 and res.summary["loaded_blocks"] == 4
    assert res.steps.loc[res.steps["time"] == 20.0, "prefill_tokens"].tolist() == [1]


def test_a_tier_too_small_for_a_request_fails_its_stores_and_retries() -> None:
    """2 chunks cannot take a 4-chunk offer (nothing evictable): every offer fails and is made
    again at the request's next scheduled step (vLLM `_build_store_jobs`: next_stored_chunk_idx
    does not advance on None), and a finished request's once more at the next step, an empty one
    taken at once (vllm/v1/core/sched/scheduler.py `has_requests`: finished requests keep the
    engine stepping): a, f and b offer 3 times each."""
    s = _run(_evicted_prefix(), chunks=2).summary
    assert (s["stored_blocks"], s["offload_store_failures"], s["offload_hit_tokens"]) == (0, 9, 0)


def test_store_threshold_two_stores_a_chunk_the_second_time_it_is_offered() -> None:
    """vLLM `CPUOffloadingManager.prepare_store` with store_threshold 2: a's chunks are offered once
    (skipped, and not offered again by a), then by b, which stores them; b's own is skipped."""
    s = _run(_evicted_prefix(), offload_store_threshold=2).summary
    assert (s["stored_blocks"], s["offload_hit_tokens"]) == (4, 0)


@pytest.mark.parametrize("change", [{"async_scheduling": True}, {"preemption": "swap", "num_cpu_blocks": 4},
                                    {"defrag_threshold": 4}, {"kv_offloading_size": -1.0},
                                    {"offload_eviction_policy": "fifo"}])
def test_unsupported_combinations_are_config_errors(change) -> None:
    """record_ops is supported: tests/gpu/test_offload_replay.py replays the store and load ops."""
    with pytest.raises(ConfigError, match="kv_offloading_size|offload_eviction_policy"):
        SimConfig(**{"kv_offloading_size": 1.0, **change}).validate()
