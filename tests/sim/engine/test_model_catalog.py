"""The catalog's models read from their published config.json files (sim/engine/configs/), each
layer's KV-cache spec and page size, and the block count against vLLM 0.33's own sizing functions.

Layer patterns follow vLLM 0.33's model files: gpt_oss.py (`layer_idx % 2 == 0` is sliding),
gemma3.py (`config.layer_types`, which transformers' Gemma3TextConfig derives from
`sliding_window_pattern`), llama4.py (`no_rope_layers[i] == 0` is a NoPE full-attention layer,
the others chunked local), qwen3_next.py (`config.layer_types`, from `full_attention_interval`).
Page sizes follow vllm/v1/kv_cache_interface.py (`AttentionSpec.page_size_bytes`,
`MLAAttentionSpec`, `MambaSpec.page_size_bytes`); GDN state shapes mamba_utils.py
`MambaStateShapeCalculator.gated_delta_net_state_shape`."""

from __future__ import annotations

import pytest

from kvsim.sim.engine.catalog import ConfigError
from kvsim.sim.engine.config import SimConfig
from kvsim.sim.engine.cost_model import CostModel
from kvsim.sim.engine.hf_config import DEFAULTS, catalog_names, model_spec
from kvsim.sim.engine.layers import describe_layers, kv_layers, place

F, S, C, L = "full_attention", "sliding_attention", "chunked_attention", "linear_attention"


def _types(name: str) -> list[str]:
    m = model_spec(name)
    return [m.layer_type(i) for i in range(m.num_layers)]


def test_each_catalog_models_layer_pattern_is_the_one_vllm_builds():
    assert _types("gemma-3-27b") == [F if (i + 1) % 6 == 0 else S for i in range(62)]
    assert _types("gemma-3-12b") == [F if (i + 1) % 6 == 0 else S for i in range(48)]
    assert _types("gpt-oss-20b") == [S if i % 2 == 0 else F for i in range(24)]
    assert _types("gpt-oss-120b") == [S if i % 2 == 0 else F for i in range(36)]
    assert _types("llama-4-scout") == [F if (i + 1) % 4 == 0 else C for i in range(48)]
    assert _types("qwen3-next-80b-a3b") == [F if (i + 1) % 4 == 0 else L for i in range(48)]
    for dense in ("qwen3-8b", "qwen3-32b", "mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3"):
        assert set(_types(dense)) == {F}, dense
    windows = {n: (model_spec(n).sliding_window, model_spec(n).attention_chunk_size)
               for n in ("gemma-3-27b", "gemma-3-12b", "gpt-oss-20b", "llama-4-scout")}
    assert windows == {"gemma-3-27b": (1024, None), "gemma-3-12b": (1024, None), "gpt-oss-20b": (128, None),
                       "llama-4-scout": (None, 8192)}


@pytest.mark.parametrize(("name", "total", "active"), [
    ("gemma-3-27b", 27_432_406_640, 27_009_346_304),  # the checkpoint's safetensors total (vision tower too)
    ("gemma-3-12b", 12_187_325_040, 11_766_034_176),
    ("gpt-oss-20b", 20_914_757_184, 4_187_440_704),  # OpenAI: 20.91B, 3.61B active + the 0.58B embedding
    ("gpt-oss-120b", 116_829_156_672, 5_711_982_912),  # 116.83B, 5.13B active + 0.58B
    ("llama-4-scout", 108_641_793_536, 17_172_894_720),  # Meta: 109B total, 17B active
    ("qwen3-32b", 32_762_123_264, 32_762_123_264),
    ("qwen3-next-80b-a3b", 79_674_391_296, 3_874_929_408),  # the MTP layer left out, as vLLM does
])
def test_parameter_counts(name, total, active):
    m = model_spec(name)
    assert (m.num_params, m.active_params()) == (total, active)


@pytest.mark.parametrize(("name", "tp", "dtype", "pages"), [
    # 2 (K, V) x KV heads on the rank x head_dim x 16 tokens x bytes
    ("gemma-3-27b", 1, None, {"sliding_window 1024": 2 * 16 * 128 * 16 * 2, "full": 131_072}),
    ("gpt-oss-20b", 1, None, {"sliding_window 128": 2 * 8 * 64 * 16 * 2, "full": 32_768}),
    ("gpt-oss-20b", 1, 1, {"sliding_window 128": 16_384, "full": 16_384}),  # --kv-cache-dtype fp8
    ("llama-4-scout", 4, None, {"chunked_local 8192": 2 * 2 * 128 * 16 * 2, "full": 16_384}),
    ("qwen3-32b", 16, None, {"full": 2 * 1 * 128 * 16 * 2}),  # fewer KV heads than ranks: one each
    ("deepseek-v3", 8, None, {"mla": 16 * (512 + 64) * 2}),  # one latent + rotary key, every rank
    # conv state (2*16*128 + 32*128) / 2 x 3, recurrent 32/2 x 128 x 128, in bf16
    ("qwen3-next-80b-a3b", 2, None, {"mamba": (4096 * 3 + 16 * 128 * 128) * 2, "full": 2 * 1 * 256 * 16 * 2}),
])
def test_page_bytes_of_each_layer_kind(name, tp, dtype, pages):
    layers = kv_layers(model_spec(name), tp, 16, dtype)
    got = {(f"{x.kind} {x.window}" if x.window else x.kind): x.page_bytes for x in layers}
    assert got == pages


def test_a_model_mixing_windows_keeps_vllms_hybrid_groups_or_its_fallback_and_says_which():
    m = model_spec("gemma-3-27b")
    layers = kv_layers(m)
    p = place(m, layers)
    hybrid = CostModel.from_config(SimConfig(model="gemma-3-27b").validate())  # vLLM's default on CUDA
    assert (hybrid.kv_bytes_per_block, hybrid.placement.approximation) == (10 * 131_072, None)  # groups of 10
    off = CostModel.from_config(SimConfig(model="gemma-3-27b", disable_hybrid_kv_cache_manager=True).validate())
    assert (off.kv_bytes_per_block, p.window, off.layout) == (62 * 131_072, None, None)  # every layer, every token
    assert off.placement.approximation == p.approximation
    assert p.approximation.startswith("gemma-3-27b mixes 52 sliding window 1,024, 10 full attention layers, kept as "
                                      "vLLM keeps them with its hybrid KV-cache manager off")
    assert describe_layers(layers) == ("62 layers: 52 sliding window 1,024, 10 full attention; "
                                       "131,072 bytes a page each")
    dense = place(model_spec("qwen3-8b"), kv_layers(model_spec("qwen3-8b")))
    assert dense.approximation is None


@pytest.mark.parametrize(("gpu", "tp", "block", "alignment"), [
    ("h100-sxm", 4, 320, 320), ("h100-sxm", 1, 576, 576), ("h200", 2, 576, 576),
    ("a100-80g", 4, 272, None), ("a100-80g", 1, 544, None)])
def test_a_gated_delta_net_hybrid_gets_vllms_raised_block_size_and_padded_pages(gpu, tp, block, alignment):
    # vllm/platforms/interface.py _align_hybrid_block_size: Qwen3-Next's state at TP 4 is
    # (3 x 8192/4 + 32/4 x 128 x 128) x 2 = 274,432 bytes; an attention token 1 KV head x 256 x 2 x 2 =
    # 1,024 bytes. Hopper prefills with FlashInfer (checkpoint alignment 64): 64 x cdiv(274,432, 64 x
    # 1,024) = 320; the A100 with Triton's kernels (16): 16 x 17 = 272. TP 1: 1,097,728 / 2,048 bytes
    cost = CostModel.from_config(SimConfig(model="qwen3-next-80b-a3b", gpu=gpu, tensor_parallel=tp).validate())
    layout = cost.layout
    assert (cost.block_size, layout.block_size, layout.checkpoint_alignment) == (block, block, alignment)
    per_token = (1 if tp > 1 else 2) * 256 * 2 * 2
    # every page padded to the attention page; groups of 12: three of gated-delta-net layers, then full attention
    assert layout.bytes_per_block == cost.kv_bytes_per_block == 12 * block * per_token
    assert [g.layer.kind for g in layout.groups] == ["mamba"] * 3 + ["full"]
    assert [g.layers[:2] for g in layout.groups] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    with pytest.raises(ConfigError, match="no fallback without them"):  # vLLM has none for Mamba state
        CostModel.from_config(SimConfig(model="qwen3-next-80b-a3b", tensor_parallel=4,
                                        disable_hybrid_kv_cache_manager=True).validate()).num_gpu_blocks(
            SimConfig(model="qwen3-next-80b-a3b", tensor_parallel=4))


def test_sliding_layers_read_at_most_their_window():
    gpu = "h100-sxm"
    oss = CostModel.from_config(SimConfig(model="gpt-oss-20b", gpu=gpu).validate())
    # a long decode batch: the 12 full layers read all 64 x 8,000 tokens, the 12 sliding ones 64 x 128
    long, short = oss.step_time(0, 64, 64 * 8000, 64), oss.step_time(0, 64, 64 * 128, 64)
    full = CostModel(oss.model.__class__(**{**oss.model.__dict__, "layer_types": (), "sliding_window": None}), oss.gpu)
    assert full.step_time(0, 64, 64 * 8000, 64) > long > short
    memory_rate = oss.gpu.hbm_bw * oss.calibration.memory
    per_token_full_layers = 12 * 32_768 / 16  # bytes a token in the 12 full layers
    # the extra context is read by the full layers only: (8000 - 128) x 64 tokens
    assert long - short == pytest.approx((8000 - 128) * 64 * per_token_full_layers / memory_rate, rel=1e-9)


def test_gpt_oss_weights_count_its_mxfp4_experts_at_4_25_bits():
    cost = CostModel.from_config(SimConfig(model="gpt-oss-20b").validate())
    m = cost.model
    experts = m.moe_layers * m.num_experts * m.expert_params()
    assert cost.weight_bytes == (m.num_params - experts) * 2 + experts * 0.53125
    assert round(cost.weight_bytes / 1e9, 2) == 13.75


def test_the_defaults_table_is_transformers_own():
    transformers = pytest.importorskip("transformers")
    classes = {"Gemma3": transformers.Gemma3TextConfig, "Llama4": transformers.Llama4TextConfig,
               "Qwen3Next": transformers.Qwen3NextConfig, "GptOss": transformers.GptOssConfig,
               "Jamba": transformers.JambaConfig, "NemotronH": transformers.NemotronHConfig}
    patterns = {  # fields transformers only uses to fill in the layer list: checked through that list
        ("Gemma3", "sliding_window_pattern"): lambda c: c.layer_types == [F if (i + 1) % 6 == 0 else S
                                                                         for i in range(c.num_hidden_layers)],
        ("Qwen3Next", "full_attention_interval"): lambda c: c.layer_types == [F if (i + 1) % 4 == 0 else L
                                                                             for i in range(c.num_hidden_layers)],
        ("Qwen3Next", "attn_output_gate"): lambda c: not hasattr(c, "attn_output_gate"),  # vLLM's getattr default
    }
    for family, fields in DEFAULTS.items():
        made = classes[family]()
        for field, value in fields.items():
            if (family, field) in patterns:
                assert patterns[family, field](made), (family, field)
            else:
                assert getattr(made, field) == value, (family, field)
    assert DEFAULTS["Gemma3"]["sliding_window_pattern"] == 6 and DEFAULTS["Qwen3Next"]["full_attention_interval"] == 4


def test_every_catalog_config_reads():
    for name in catalog_names():
        assert model_spec(name).name == name


@pytest.mark.needs_vllm
def test_block_counts_equal_vllms_sizing_functions_on_h100_and_h200():
    """vllm/v1/core/kv_cache_planning.py get_kv_cache_groups + get_kv_cache_config_from_groups, with
    the specs built by vLLM's spec classes, for the memory kvsim finds left for the cache."""
    from kvsim.sim.conform.vllm_sizing import table

    rows = table(list(catalog_names()))
    assert {(r.model, r.gpu) for r in rows} == {(m, g) for m in catalog_names() for g in ("h100-sxm", "h200")} - {
        ("deepseek-v3", "h100-sxm")}  # 671B in fp8 does not fit on eight H100s
    for r in rows:
        assert r.kvsim_blocks == r.vllm_blocks, r
    by = {(r.model, r.gpu): r for r in rows}
    # vLLM's hybrid manager (its CUDA default, and kvsim's) keeps sliding layers' blocks to the window:
    # 6.2x the blocks of its fallback for Gemma; chunked local attention stays in the fallback by default
    assert (by["gemma-3-27b", "h100-sxm"].kvsim_blocks, by["gemma-3-27b", "h100-sxm"].vllm_hybrid_blocks) == \
        (14_150, 14_150)
    scout = by["llama-4-scout", "h200"]
    assert scout.kvsim_blocks == scout.vllm_blocks < scout.vllm_hybrid_blocks
    assert by["qwen3-next-80b-a3b", "h200"].kvsim_blocks == 7_636  # 12 x 576 tokens x 1,024 bytes a block
    # kvsim's grouping (layers.hybrid_layout) is vLLM's: the same layers in the same groups, the same blocks
    mixed = [r for r in rows if r.vllm_hybrid_blocks is not None]
    assert {r.model for r in mixed} == {"gemma-3-12b", "gemma-3-27b", "gpt-oss-20b", "gpt-oss-120b", "llama-4-scout",
                                        "qwen3-next-80b-a3b"}
    for r in mixed:
        assert r.groups_equal and r.kvsim_hybrid_blocks == r.vllm_hybrid_blocks, r


def test_vllms_hybrid_grouping_hand_worked():
    # kv_cache_planning.py _get_kv_cache_groups_uniform_page_size: gemma-3-27b's 52 sliding and 10 full
    # layers: group size 10 (52 >= 1.5 x 10), the sliding bucket in cdiv(52, 10) = 6 interleaved groups
    from kvsim.sim.engine.layers import hybrid_layout

    m = model_spec("gemma-3-27b")
    h = hybrid_layout(kv_layers(m), m.name)
    sliding = [i for i in range(62) if (i + 1) % 6]
    assert h.group_size == 10 and [g.layers for g in h.groups] == [tuple(sliding[k::6]) for k in range(6)] + [
        tuple(range(5, 62, 6))]
    assert h.bytes_per_block == 10 * 131_072
    assert h.describe() == ("7 groups of 10 layers (6 sliding window 1,024, 1 full attention), 1,310,720 bytes a "
                            "block")
    # 12 and 12 (gpt-oss-20b): one group each; 13 and 12 would pad to 13 (below 1.5 x 12)
    oss = model_spec("gpt-oss-20b")
    assert [len(g.layers) for g in hybrid_layout(kv_layers(oss)).groups] == [12, 12]


def test_kvsim_run_on_a_config_file_says_what_it_read_and_how_the_cache_is_placed(tmp_path, monkeypatch):
    import json
    import shutil

    from typer.testing import CliRunner

    from kvsim.sim.cli.app import app
    from kvsim.sim.engine.hf_config import CONFIG_DIR

    (tmp_path / "my-oss").mkdir()
    shutil.copy(CONFIG_DIR / "gpt-oss-20b.json", tmp_path / "my-oss" / "config.json")
    monkeypatch.chdir(tmp_path)
    # (sync: the groups' figures below were worked out for vLLM's step-by-step scheduler)
    r = CliRunner().invoke(app, ["run", "--model", "my-oss", "--num-gpu-blocks", "400", "--no-plots", "-o", "run",
                                 "--no-async-scheduling"])
    assert r.exit_code == 0, r.output
    out = " ".join(r.output.split())
    assert ("model: read from my-oss's config: 24 layers: 12 sliding window 128, 12 full attention; 32,768 bytes "
            "a page each; 64 query and 8 KV heads of 64; 20.91B parameters (4.19B active: 4 of 32 experts a token on "
            "24 layers)") in out
    assert ("KV cache: the model's 16-bit elements, 393,216 bytes a block of 16 tokens (a page of each of a "
            "group's 12 layers) on the GPU") in out
    # vLLM's hybrid KV-cache groups (its default on CUDA): kind, window, layers, block size, bytes a block
    assert ("KV-cache groups (vLLM 0.33's hybrid manager, one pool of 400 blocks of 16 tokens, 393,216 bytes each): "
            "0: sliding window 128, layers 0-22 every 2nd; 1: full attention, layers 1-23 every 2nd") in out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["kv_layers"], summary["kv_bytes_per_block"], summary["num_gpu_blocks"]) == (
        "24 layers: 12 sliding window 128, 12 full attention; 32,768 bytes a page each", 393_216, 400)
    assert summary["cache_approximation"] is None
    # and what each did: its blocks in use at most (distinct: a shared hit counts once), blocks the
    # window let go of, the hit each alone offered, its cached blocks evicted (10,468 in all)
    # (both at least the 62,528 tokens every group agreed on)
    assert summary["kv_cache_groups"] == [
        {"group": 0, "kind": "sliding_window", "window": 128, "layers": list(range(0, 24, 2)), "block_size": 16,
         "bytes_per_block": 393_216, "peak_blocks": 128, "blocks_freed_behind_window": 7_888, "own_hit_tokens": 63_856,
         "evicted_blocks": 2_163},
        {"group": 1, "kind": "full", "window": None, "layers": list(range(1, 24, 2)), "block_size": 16,
         "bytes_per_block": 393_216, "peak_blocks": 335, "blocks_freed_behind_window": 0, "own_hit_tokens": 68_560,
         "evicted_blocks": 8_305}]
    assert summary["hit_tokens"] == 62_528
    r = CliRunner().invoke(app, ["run", "--model", "my-oss", "--num-gpu-blocks", "400", "--no-plots", "-o", "off",
                                 "--disable-hybrid-kv-cache-manager"])
    assert r.exit_code == 0, r.output
    out = " ".join(r.output.split())
    assert "786,432 bytes a block of 16 tokens (every attention layer)" in out
    assert "approximation: my-oss mixes 12 sliding window 128, 12 full attention layers, kept as vLLM keeps" in out
    summary = json.loads((tmp_path / "off" / "summary.json").read_text())
    assert summary["cache_approximation"].endswith("attention still reads only each layer's window")
    assert "--disable-hybrid-kv-cache-manager" in summary["cache_approximation"]


JAMBA = {"architectures": ["JambaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 65536, "num_experts": 16,
         "num_experts_per_tok": 2, "max_position_embeddings": 262144}  # the rest: transformers' JambaConfig defaults
NEMOTRON_H = {"architectures": ["NemotronHForCausalLM"], "hidden_size": 4096, "intermediate_size": 21504,
              "num_hidden_layers": 8, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
              "vocab_size": 131072, "max_position_embeddings": 8192, "hybrid_override_pattern": "M-M*-M-M",
              "mamba_num_heads": 128, "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128, "conv_kernel": 4}


HERE = __import__("pathlib").Path(__file__).parent


@pytest.mark.parametrize(("file", "total", "active", "pattern"), [
    # ai21labs/Jamba-v0.1 at 9efd115 (51.57B on the Open LLM Leaderboard; 52B / 12B in AI21's card)
    ("jamba-v0.1.json", 51_570_323_328, 12_110_311_296, [F if i % 8 == 4 else L for i in range(32)]),
    # nvidia/Nemotron-H-8B-Base-8K at 94ea861: 24 Mamba2, 4 attention, 24 MLP layers ("8B")
    ("nemotron-h-8b-base-8k.json", 8_100_852_736, 8_100_852_736, None),
])
def test_the_published_jamba_and_nemotron_h_configs(file, total, active, pattern):
    """Their files (tests/sim/engine/configs/, byte-identical to the hub's at those revisions by size
    and sha256 recorded in dinoml/model-configs-rs) read as vLLM's jamba.py and nemotron_h.py."""
    from kvsim.sim.engine.hf_config import load_config

    m = load_config(str(HERE / "configs" / file))
    assert (m.num_params, m.active_params()) == (total, active)
    types = [m.layer_type(i) for i in range(m.num_layers)]
    if pattern is not None:
        assert types == pattern
    else:
        assert (types.count(L), types.count(F), types.count("mlp")) == (24, 4, 24)


def test_jamba_and_nemotron_h_layers_from_their_patterns():
    from kvsim.sim.engine.hf_config import spec_from_config

    jamba = spec_from_config(JAMBA, "jamba.json")
    # jamba.py layers_block_type: attention iff i % 8 == 4; experts iff i % 2 == 1
    assert [jamba.layer_type(i) for i in range(32)] == [F if i % 8 == 4 else L for i in range(32)]
    assert (jamba.moe_layers, jamba.num_params, jamba.active_params()) == (16, 51_570_323_328, 12_110_311_296)
    nem = spec_from_config(NEMOTRON_H, "nemotron.json")
    assert [nem.layer_type(i) for i in range(8)] == [L, "mlp", L, F, "mlp", L, "mlp", L]
    assert describe_layers(kv_layers(nem)) == (
        "8 layers: 4 state-space (Mamba or gated-delta-net) state, 1 full attention, 3 feed-forward only (no cache); "
        "state-space (Mamba or gated-delta-net) state 4,255,744 bytes a page; full attention 65,536 bytes a page")
    with pytest.raises(ConfigError, match=r"field 'hybrid_override_pattern': 'E' is a mixture-of-experts layer"):
        spec_from_config({**NEMOTRON_H, "hybrid_override_pattern": "M-M*-M-E"}, "nemotron.json")
    with pytest.raises(ConfigError, match=r"field 'hybrid_override_pattern': expected 8 characters"):
        spec_from_config({**NEMOTRON_H, "hybrid_override_pattern": "M-M"}, "nemotron.json")


@pytest.mark.needs_vllm
@pytest.mark.parametrize("tp", [1, 2, 4, 16])
def test_state_pages_equal_vllms_mamba_specs(tp):
    """vllm/model_executor/layers/mamba/mamba_utils.py MambaStateShapeCalculator (mamba1, mamba2 with its
    extra groups, gated delta net) and vllm/v1/kv_cache_interface.py MambaSpec.page_size_bytes."""
    import torch
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator as Calc
    from vllm.v1.kv_cache_interface import MambaSpec

    from kvsim.sim.engine.hf_config import spec_from_config

    def page(shapes, dtypes):
        return MambaSpec(block_size=16, shapes=tuple(shapes), dtypes=dtypes).page_size_bytes

    bf16, fp32 = torch.bfloat16, torch.float32
    jamba, nem, nxt = spec_from_config(JAMBA, "j"), spec_from_config(NEMOTRON_H, "n"), model_spec("qwen3-next-80b-a3b")
    want = {
        "jamba": page(Calc.mamba1_state_shape(tp, 8192, 16, 4), (bf16, bf16)),
        "nemotron": page(Calc.mamba2_state_shape(tp, 8192, 8, 128, 64, 128, 4), (bf16, fp32)),
        "qwen3-next": page(Calc.gated_delta_net_state_shape(tp, 16, 32, 128, 128, 4), (bf16, bf16)),
    }
    got = {name: next(x.page_bytes for x in kv_layers(m, tp) if x.kind == "mamba")
           for name, m in (("jamba", jamba), ("nemotron", nem), ("qwen3-next", nxt))}
    assert got == want
