"""A sliding window's prefix-cache retention against vLLM 0.33, built as `vllm serve` builds it.

vLLM's side comes from its config objects and planning functions (sim/conform/vllm_setup.py
`stand_in_config`, `kv_cache_config`: vllm/v1/core/kv_cache_planning.py `get_kv_cache_groups`,
`get_kv_cache_config_from_groups`), so `CacheConfig.prefix_cache_retention_interval` keeps vLLM's
default 0 (vllm/config/cache.py) unless a case sets it. Before, the drivers built KVCacheConfig by
hand and its field defaulted to None: they checked the dense rule, which `vllm serve` does not run.
"""

from __future__ import annotations

import random

import pytest

from kvsim.sim.conform.check import conform, run_manager
from kvsim.sim.engine.config import SimConfig
from kvsim.workloads.request import make_request

needs_vllm = pytest.mark.needs_vllm


def _first_turns(n: int = 24, system: int = 600, seed: int = 3) -> list:
    """First turns over one long shared system prompt, each with its own long user text: the
    shape where sparse retention hashes nothing of the system prompt."""
    rng = random.Random(seed)
    return [make_request(f"t{i}", i * 0.5, [*range(system), *range(10_000 * (i + 1), 10_000 * (i + 1) + rng.randint(300, 900))],
                         rng.randint(4, 40)) for i in range(n)]


@needs_vllm
def test_vllms_kv_cache_config_carries_its_default_retention():
    import tempfile

    from kvsim.sim.conform.vllm_setup import kv_cache_config, stand_in_config

    with tempfile.TemporaryDirectory() as tmp:
        config = stand_in_config(tmp, max_model_len=4096, cache={"block_size": 16, "enable_prefix_caching": True})
    kv = kv_cache_config(config, 100, sliding_window=256)
    assert (kv.num_blocks, kv.prefix_cache_retention_interval) == (100, 0)
    assert type(kv.kv_cache_groups[0].kv_cache_spec).__name__ == "SlidingWindowSpec"


@needs_vllm
@pytest.mark.parametrize("retention", [0, None, 64])
def test_kvsim_hits_what_vllm_hits_for_each_retention(retention):
    reqs = _first_turns()
    d = run_manager(reqs, block_size=16, num_blocks=2000, max_running=1, enable_caching=True, vllm_version="0.33",
                    sliding_window=256, prefix_cache_retention_interval=retention)
    assert d.ok, d.format()
    cfg = SimConfig(block_size=16, step_time=0.05, closed_loop_sessions=False, num_gpu_blocks=400,
                    sliding_window=256, prefix_cache_retention_interval=retention).validate()
    assert [x.format() for x in conform(reqs, cfg, "scheduler") if not x.ok] == []


def test_sparse_retention_hits_less_than_the_dense_rule_on_shared_system_prompts():
    from kvsim.sim.conform.check import kvsim_manager

    def hits(retention):
        return sum(r["hit_tokens"] for r in kvsim_manager(
            _first_turns(), block_size=16, num_blocks=2000, max_running=1, enable_caching=True, vllm_version="0.33",
            sliding_window=256, prefix_cache_retention_interval=retention))

    # 600 shared tokens: dense hashes them (23 later turns hit 592 each), vLLM 0.33's default
    # hashes only each prompt's last 16 blocks, past the system prompt
    assert (hits(None), hits(0)) == (23 * 592, 0)
