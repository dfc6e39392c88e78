"""The roofline table (sim/studies/roofline.py): its bounds, worked by hand for one model."""

from __future__ import annotations

import pytest

from kvsim.sim.engine.cost_model import smallest_tp
from kvsim.sim.studies.roofline import markdown, rows


def test_qwen3_8b_decode_bounds_by_hand():
    decode, prefill = rows("qwen3-8b", "h100-sxm", 1)
    # bytes: the bf16 weights, and K/V of 36 layers x 8 heads x 128 (2 bytes, K and V) for every
    # token of context and the 64 new ones, over the H100's 3.35 TB/s
    weights, kv_per_token = 8_190_735_360 * 2, 36 * 2 * 8 * 128 * 2
    assert decode.memory_s == pytest.approx((weights + (64 * 2048 + 64) * kv_per_token) / 3.35e12, rel=1e-12)
    # FLOPs: 2 x params a token, and 4 x head_dim a (query, key) pair per head and layer; a decode
    # token with 2,047 tokens before it scores 2,048 keys
    flops = 2 * 8_190_735_360 * 64 + 36 * 32 * 4 * 128 * 64 * 2048
    assert decode.compute_s == pytest.approx(flops / 989e12, rel=1e-12)
    assert decode.bound == "memory" and prefill.bound == "compute"
    # the cost model: memory / 0.8 efficiency + 1 ms overhead (defaults)
    assert decode.step_s == pytest.approx(decode.memory_s / 0.8 + 1e-3, rel=1e-12)


def test_the_smallest_tensor_parallel_degree_that_holds_a_model():
    assert [smallest_tp(m, "h100-sxm") for m in ("qwen3-8b", "llama-3-70b", "llama-4-scout", "deepseek-v3")] == \
        [1, 2, 4, None]
    assert smallest_tp("deepseek-v3", "h200") == 8


def test_the_markdown_names_the_binding_bound():
    text = markdown(rows("qwen3-8b", "h100-sxm", 1))
    assert text.splitlines()[2].startswith("| qwen3-8b | 1 x h100-sxm | decode 64 x 2k | 1.14 | 10.66 | 14.33 | 1.34 (memory) |")
