"""Cost model: step times and block counts against hand-computed numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsim.sim.engine.config import ConfigError, SimConfig
from kvsim.sim.engine.cost_model import CostModel

REL = 1e-9
H100_COMPUTE = 989e12 * 0.5  # default compute efficiency
H100_MEMORY = 3.35e12 * 0.8  # default memory efficiency
LLAMA8_WEIGHTS = 8_030_261_248 * 2
LLAMA8_KV_TOKEN = 2 * 32 * 8 * 128 * 2  # K and V, layers, KV heads, head dim, bf16
LLAMA8_BLOCK = LLAMA8_KV_TOKEN * 16


def cm_for(**kw) -> CostModel:
    return CostModel.from_config(SimConfig(**kw))


def test_block_bytes() -> None:
    cm = cm_for()
    assert cm.kv_bytes_per_block == LLAMA8_BLOCK == 2_097_152
    assert cm_for(block_size=32).kv_bytes_per_block == 4_194_304
    # 16 shards, 8 KV heads: each GPU keeps one (replicated) KV head
    assert cm_for(tensor_parallel=16).kv_bytes_per_block == 2 * 32 * 1 * 128 * 2 * 16


def test_prefill_bound_step() -> None:
    # one 8192-token prompt from scratch: causal attention scores 8192 * 8193 / 2 pairs
    flops = 2 * 8_030_261_248 * 8192 + 4 * 32 * 32 * 128 * (8192 * 8193 / 2)
    compute = flops / H100_COMPUTE
    memory = (LLAMA8_WEIGHTS + LLAMA8_KV_TOKEN * (8192 + 8192)) / H100_MEMORY
    assert compute > memory
    assert cm_for().step_time(8192, 0, 8192, 1, None) == pytest.approx(compute + 1e-3, rel=REL)
    assert compute + 1e-3 == pytest.approx(0.30264233329685, rel=1e-12)


def test_chunked_prefill_with_cached_prefix() -> None:
    # a 512-token chunk after 4096 cached tokens: 512 * 4096 + 512 * 513 / 2 pairs
    flops = 2 * 8_030_261_248 * 512 + 4 * 32 * 32 * 128 * (512 * 4096 + 512 * 513 / 2)
    memory = (LLAMA8_WEIGHTS + LLAMA8_KV_TOKEN * (4608 + 512)) / H100_MEMORY
    want = max(flops / H100_COMPUTE, memory) + 1e-3
    assert cm_for().step_time(512, 0, 4608, 1) == pytest.approx(want, rel=REL)


def test_decode_bound_step() -> None:
    # 256 sequences of 1000 tokens each decode one token: 256000 pairs, 256000 KV tokens read
    flops = 2 * 8_030_261_248 * 256 + 4 * 32 * 32 * 128 * 256_000
    memory = (LLAMA8_WEIGHTS + LLAMA8_KV_TOKEN * (256_000 + 256)) / H100_MEMORY
    assert memory > flops / H100_COMPUTE
    assert cm_for().step_time(0, 256, 256_000, 256, {}) == pytest.approx(memory + 1e-3, rel=REL)
    assert memory + 1e-3 == pytest.approx(0.019525563032836, rel=1e-12)


def test_block_op_costs() -> None:
    ops = {"copy": 3, "swap_out": 2, "swap_in": 1, "move": 5, "write": 100, "free": 7, "evict": 4}
    want = (
        1e-3
        + 3 * 2 * LLAMA8_BLOCK / 3.35e12  # copy: read + write one block
        + 2 * LLAMA8_BLOCK / 50e9  # swap out over PCIe gen5
        + 1 * LLAMA8_BLOCK / 50e9
        + 5 * 4 * LLAMA8_BLOCK / 3.35e12  # move: exchange, both blocks read and written
    )
    assert cm_for().step_time(0, 0, 0, 0, ops) == pytest.approx(want, rel=REL)
    assert cm_for().step_time(0, 0, 0, 0) == 1e-3


def test_tensor_parallel_step() -> None:
    # llama-3-70b over 4 H100s: 16 query heads and 2 KV heads per GPU; 64 decodes at 2048 context
    kv_token = 2 * 80 * 2 * 128 * 2
    flops = 2 * 70_553_706_496 / 4 * 64 + 4 * 80 * 16 * 128 * (64 * 2048)
    memory = (70_553_706_496 * 2 / 4 + kv_token * (64 * 2048 + 64)) / H100_MEMORY
    allreduce = 2 * 80 * 64 * 8192 * 2 / 450e9
    cm = cm_for(model="llama-3-70b", tensor_parallel=4)
    assert cm.kv_bytes_per_block == kv_token * 16
    want = max(flops / H100_COMPUTE, memory) + allreduce + 1e-3
    assert cm.step_time(0, 64, 64 * 2048, 64) == pytest.approx(want, rel=REL)


def test_sliding_window_caps_context() -> None:
    cm = cm_for(model="mistral-7b")
    assert cm.sliding_window == 4096
    assert cm_for(model="mistral-7b", sliding_window=1024).sliding_window == 1024
    assert cm_for().sliding_window is None
    # one decode at 10000 tokens: prior context capped at 4096, KV read capped at 4096
    flops = 2 * 7_241_732_096 + 4 * 32 * 32 * 128 * (4096 + 1)
    memory = (7_241_732_096 * 2 + LLAMA8_KV_TOKEN * (4096 + 1)) / H100_MEMORY
    assert cm.step_time(0, 1, 10_000, 1) == pytest.approx(
        max(flops / H100_COMPUTE, memory) + 1e-3, rel=REL
    )


def test_calibration_overrides_defaults(tmp_path: Path) -> None:
    prof = tmp_path / "cal.json"
    prof.write_text(json.dumps({
        "version": 1, "device": "h100-sxm",
        "efficiency": {"compute": 0.4, "memory": 0.9},
        "overhead_s": 0.002, "op_cost_s": {"copy": 1e-5},
    }))  # fmt: skip
    cm = cm_for(calibration=str(prof))
    memory = (LLAMA8_WEIGHTS + LLAMA8_KV_TOKEN * (256_000 + 256)) / (3.35e12 * 0.9)
    want = memory + 0.002 + 2 * 1e-5 + LLAMA8_BLOCK / 50e9
    got = cm.step_time(0, 256, 256_000, 256, {"copy": 2, "swap_in": 1})
    assert got == pytest.approx(want, rel=REL)
    flops = 2 * 8_030_261_248 * 8192 + 4 * 32 * 32 * 128 * (8192 * 8193 / 2)
    assert cm.step_time(8192, 0, 8192, 1) == pytest.approx(flops / (989e12 * 0.4) + 0.002, rel=REL)
    assert cm.calibration.device == "h100-sxm"


def test_partial_calibration_keeps_other_defaults(tmp_path: Path) -> None:
    prof = tmp_path / "cal.json"
    prof.write_text('{"overhead_s": 0}')
    assert cm_for(calibration=str(prof)).step_time(0, 0, 0, 0, {"move": 1}) == pytest.approx(
        4 * LLAMA8_BLOCK / 3.35e12, rel=REL
    )


def test_derived_num_gpu_blocks_llama8b_h100() -> None:
    # vLLM's budget: 0.9 of 81559 MiB, less weights, less activations of an 8192-token
    # profiling pass (3 * intermediate + 4 * hidden per token, bf16), fp32 logits for
    # 1024 rows (vLLM 0.33's max_num_seqs on an H100) and 1 GiB non-torch memory;
    # divided by 2 MiB blocks
    budget = 81559 * 2**20 * 0.9
    activations = 8192 * (3 * 14336 + 4 * 4096) * 2 + 1024 * 128256 * 4 + 2**30
    want = int((budget - LLAMA8_WEIGHTS - activations) // LLAMA8_BLOCK)
    assert want == 27816
    cfg = SimConfig()
    assert CostModel.from_config(cfg).num_gpu_blocks(cfg) == 27816
    cfg = SimConfig(num_gpu_blocks=500)
    assert CostModel.from_config(cfg).num_gpu_blocks(cfg) == 500


def test_model_that_does_not_fit() -> None:
    cfg = SimConfig(model="llama-3-70b")
    with pytest.raises(
        ConfigError,
        match=r"llama-3-70b does not fit on h100-sxm with tensor_parallel=1.*141\.1 GB weights",
    ):
        CostModel.from_config(cfg).num_gpu_blocks(cfg)
    cfg = SimConfig(model="llama-3-70b", tensor_parallel=2)
    assert CostModel.from_config(cfg).num_gpu_blocks(cfg) == 1363


def test_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown model 'llama-2'"):
        cm_for(model="llama-2")
    with pytest.raises(
        ConfigError, match="tensor_parallel 3 must divide llama-3-8b's 32 attention heads"
    ):
        cm_for(tensor_parallel=3)
    with pytest.raises(ConfigError, match=r"calibration .*missing\.json: cannot read"):
        cm_for(calibration=str(tmp_path / "missing.json"))
    cases = {
        "bad.json": ("{not json", "not JSON"),
        "typo.json": ('{"efficiency": {"comptue": 0.5}}', "unknown key efficiency.comptue"),
        "top.json": ('{"overhead": 0.5}', "unknown key overhead;"),
        "neg.json": (
            '{"op_cost_s": {"swap_in": -1}}',
            r"op_cost_s.swap_in must be a number >= 0, got -1",
        ),
        "zero.json": (
            '{"efficiency": {"memory": 0}}',
            "efficiency.memory must be a positive number",
        ),
        "ver.json": ('{"version": 2}', "version 2, this kvsim reads 1"),
        "list.json": ("[1]", "expected a JSON object"),
        "launch.json": ('{"launch_s": {"decode": 1e-6}}', "unknown key launch_s.decode"),
        "launchneg.json": ('{"launch_s": {"write": -1e-6}}', r"launch_s.write must be a number >= 0"),
        "launchlist.json": ('{"launch_s": [1]}', "'launch_s' must be an object"),
    }
    for name, (text, msg) in cases.items():
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(ConfigError, match=rf"calibration {path}: {msg}"):
            cm_for(calibration=str(path))


def test_launch_costs_default_per_kind_and_from_a_profile(tmp_path):
    """launch_s: one launch's GPU time per replay kernel kind; DEFAULT_LAUNCH_S where a profile is silent."""
    from kvsim.sim.engine.cost_model import (
        DEFAULT_LAUNCH_S,
        LAUNCH_KINDS,
        Calibration,
        load_calibration,
    )

    assert LAUNCH_KINDS == ("write", "attention", "copy", "swap_out", "swap_in", "move")
    assert Calibration().launch_costs() == dict.fromkeys(LAUNCH_KINDS, 2e-6) == dict.fromkeys(LAUNCH_KINDS, DEFAULT_LAUNCH_S)
    path = tmp_path / "cal.json"
    path.write_text('{"launch_s": {"write": 3e-6, "attention": 1.25e-5}}')
    cal = load_calibration(path)
    assert cal.launch_s == (("write", 3e-6), ("attention", 1.25e-5))
    assert cal.launch_costs() == {"write": 3e-6, "attention": 1.25e-5, "copy": 2e-6, "swap_out": 2e-6,
                                  "swap_in": 2e-6, "move": 2e-6}


# --------------------------------------------------------------- attention pairs of prefill chunks



def _pairs_model(window: int | None = None) -> CostModel:
    """Llama-3-8B whose GEMMs and memory cost nothing: compute = attention pairs x seconds a pair."""
    from kvsim.sim.engine.catalog import get_gpu, get_model
    from kvsim.sim.engine.cost_model import Calibration

    off = Calibration(compute=1e30, attention=1.0, memory=1e30, overhead_s=0.0)
    return CostModel(get_model("llama-3-8b"), get_gpu("h100-sxm"), calibration=off, sliding_window=window)


def _pairs(cm: CostModel, *args, chunks=()) -> float:
    """The attention pairs bounds() charges a batch, in units of one decode over one token."""
    return cm.bounds(*args, chunks=chunks)[0] / cm.bounds(0, 1, 1, 1)[0]


def test_prefill_chunks_make_the_attention_pairs_exact():
    """sim/engine/cost_model.py CostModel.bounds: with each chunk's (prior, new), a chunk scores
    n*c + n(n+1)/2 pairs and the decodes their context; from the totals alone prior context is spread
    evenly. 96 decodes at 256 beside 6,144 new tokens after 8,192 (a long prompt's second chunk):"""
    cm = _pairs_model()
    batch = (6144, 96, 96 * 256 + 8192 + 6144, 97)
    exact = 96 * 256 + 6144 * 8192 + 6144 * 6145 // 2
    assert exact == 69_233_664
    assert _pairs(cm, *batch, chunks=[(8192, 6144)]) == pytest.approx(exact, rel=1e-12)
    estimate = 6240 * (batch[2] - 6240) / 97 + 96 + 6144 * 6145 / 2  # the even spread
    assert _pairs(cm, *batch) == pytest.approx(estimate, rel=1e-12)
    assert exact / estimate == pytest.approx(3.3001, abs=1e-4)
    # one chunk alone: both ways exact (the estimate's case)
    assert _pairs(cm, 512, 0, 1512, 1, chunks=[(1000, 512)]) == pytest.approx(
        _pairs(cm, 512, 0, 1512, 1), rel=1e-12)
    assert _pairs(cm, 512, 0, 1512, 1, chunks=[(1000, 512)]) == pytest.approx(1000 * 512 + 512 * 513 // 2, rel=1e-12)


def test_a_window_caps_each_querys_keys_at_window_plus_one():
    """A query scores at most w + 1 keys (a decode's prior capped at w, as the estimate does): a chunk
    of 50 after 100 under a window of 128 scores 29 queries of 101..129 keys and 21 of 129."""
    cm = _pairs_model(window=128)
    assert _pairs(cm, 50, 0, 150, 1, chunks=[(100, 50)]) == pytest.approx(
        sum(min(100 + k, 129) for k in range(1, 51)), rel=1e-12)
    assert sum(min(100 + k, 129) for k in range(1, 51)) == 6044
    # decodes beside it: 3 at context 1,000 score 129 each
    assert _pairs(cm, 50, 3, 3150, 4, chunks=[(100, 50)]) == pytest.approx(6044 + 3 * 129, rel=1e-12)


@given(st.lists(st.tuples(st.integers(0, 5000), st.integers(1, 3000)), min_size=1, max_size=5),
       st.integers(0, 40), st.sampled_from([None, 16, 128, 4096]), st.randoms())
def test_chunk_pairs_are_the_per_query_sum_and_order_free(chunks, decodes, window, rnd):
    cm = _pairs_model(window)
    dec_ctx = decodes * 700
    context = dec_ctx + sum(c + n for c, n in chunks)
    tokens = sum(n for _, n in chunks)
    cap = None if window is None else window + 1
    want = sum(min(c + k, cap) if cap else c + k for c, n in chunks for k in range(1, n + 1))
    want += decodes * (min(700, cap) if cap else 700)
    got = _pairs(cm, tokens, decodes, context, len(chunks) + decodes, chunks=chunks)
    assert got == pytest.approx(want, rel=1e-12)
    shuffled = list(chunks)
    rnd.shuffle(shuffled)
    args = (tokens, decodes, context, len(chunks) + decodes)
    assert cm.step_time(*args, None, shuffled) == cm.step_time(*args, None, chunks)  # bit for bit


def test_steps_without_chunks_keep_the_estimate_bit_for_bit():
    """All-decode steps (the quiet runs pass none) take the totals' path, unchanged."""
    cm = cm_for()
    assert cm.step_time(0, 64, 64 * 2048, 64, None, ()) == cm.step_time(0, 64, 64 * 2048, 64)
