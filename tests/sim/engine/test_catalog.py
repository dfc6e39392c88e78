"""The model and GPU catalogue: published numbers, name lookup, clear errors."""

from __future__ import annotations

import pytest

from kvsim.sim.engine.catalog import GPUS, MODELS, get_gpu, get_model
from kvsim.sim.engine.config import ConfigError


@pytest.mark.parametrize("name", sorted(MODELS))
def test_param_counts_match_shapes(name: str) -> None:
    m = MODELS[name]
    assert m.count_params() == m.num_params


def test_published_model_numbers() -> None:
    m = get_model("llama-3-8b")
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim) == (
        32,
        4096,
        32,
        8,
        128,
    )
    assert (m.intermediate_size, m.vocab_size, m.max_model_len, m.sliding_window) == (
        14336,
        128256,
        8192,
        None,
    )
    assert get_model("mistral-7b").sliding_window == 4096
    assert get_model("llama-3-70b").num_params == 70_553_706_496
    assert get_model("qwen2.5-7b").num_kv_heads == 4


def test_published_gpu_numbers() -> None:
    h100 = get_gpu("h100-sxm")
    assert (h100.peak_flops, h100.hbm_bw, h100.memory_bytes) == (989e12, 3.35e12, 81559 * 2**20)
    assert (get_gpu("a100-80g").peak_flops, get_gpu("a100-80g").hbm_bw) == (312e12, 2.039e12)
    assert get_gpu("h200").hbm_bw == 4.8e12
    assert get_gpu("l40s").nvlink_bw is None


def test_names_are_case_insensitive_with_aliases() -> None:
    assert get_model("Llama-3-8B") is MODELS["llama-3-8b"]
    assert get_model("meta-llama/Meta-Llama-3-8B") is MODELS["llama-3-8b"]
    assert get_model(" Mistral-7B-v0.1 ") is MODELS["mistral-7b"]
    assert get_gpu("H100") is GPUS["h100-sxm"]
    assert get_gpu("A100-80GB") is GPUS["a100-80g"]


def test_unknown_names_list_the_choices() -> None:
    with pytest.raises(
        ConfigError,
        match=r"unknown model 'gpt-5'; choose from llama-3-8b, llama-3-70b, qwen2.5-7b, mistral-7b",
    ):
        get_model("gpt-5")
    with pytest.raises(
        ConfigError, match=r"unknown gpu 'v100'; choose from a100-80g, h100-sxm, h200, l40s"
    ):
        get_gpu("v100")


def test_batch_defaults_are_vllm_serve_0_33s() -> None:
    # vllm/engine/arg_utils.py EngineArgs.get_batch_defaults (0.33), OPENAI_API_SERVER column:
    # H100/H200 (>= 70 GiB, not A100) 8192 tokens and 1024 sequences; A100 and smaller 2048, 256
    from kvsim.sim.engine.config import SimConfig

    assert SimConfig(gpu="h100-sxm").batch_limits() == (8192, 1024)
    assert SimConfig(gpu="h200").batch_limits() == (8192, 1024)
    assert SimConfig(gpu="a100-80g").batch_limits() == (2048, 256)
    assert SimConfig(gpu="l40s").batch_limits() == (2048, 256)
    assert SimConfig(gpu="a100-80g", max_num_seqs=7).batch_limits() == (2048, 7)
    # chunked prefill off: the budget is at least max_model_len
    assert SimConfig(enable_chunked_prefill=False, max_model_len=32768).batch_limits() == (32768, 1024)
