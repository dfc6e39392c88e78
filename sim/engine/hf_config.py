"""A model from its Hugging Face `config.json`, read the way vLLM 0.33's model files read it.

`--model path/to/config.json` (offline: the file only, no hub, no weights). It takes the dense
decoder families vLLM runs through its Llama-style implementations:

- `LlamaForCausalLM` and `MistralForCausalLM` (vllm/model_executor/models/llama.py, mistral.py):
  `head_dim` if the config has it, else hidden_size / num_attention_heads; `attention_bias` (or
  `bias`) puts biases on q, k, v and o; Mistral's `sliding_window` is the window of every layer;
- `Qwen2ForCausalLM` (qwen2.py): q, k, v biases always, o none; a window only with
  `use_sliding_window` (then on layers from `max_window_layers` up: a mix, refused below);
- `Qwen3ForCausalLM` (qwen3.py): `attention_bias` on q, k, v; RMSNorm of q and k per head;
- mixtures of experts with that attention: `MixtralForCausalLM` (mixtral.py) and
  `Qwen3MoeForCausalLM` (qwen3_moe.py), their experts read as `_experts` says. No expert
  parallelism: each of the tensor-parallel ranks holds its share of every expert;
- multi-head latent attention with experts: `DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`
  (deepseek_v2.py): every layer caches one latent of `kv_lora_rank` plus a rotary key of
  `qk_rope_head_dim` per token (vLLM's MLAAttentionSpec, the same on every tensor-parallel rank);
  the multi-token-prediction layers (`num_nextn_predict_layers`) are left out, as vLLM loads them
  only for speculative decoding;
- models whose layers differ (`_attention_layout` says how each file decides a layer's type):
  `GptOssForCausalLM` (gpt_oss.py: sliding window on even layers, attention sinks, biased
  experts in MXFP4), `Gemma3ForCausalLM` / `Gemma3ForConditionalGeneration` (gemma3.py,
  gemma3_mm.py: `layer_types`, q/k norms, four norms a layer, tied embeddings, a SigLIP tower),
  `Llama4ForConditionalGeneration` (llama4.py, mllama4.py: chunked-local layers with a NoPE
  full-attention layer every fourth, a shared expert, a vision tower), `Qwen3NextForCausalLM`
  (qwen3_next.py: gated-delta-net layers with full attention every `full_attention_interval`-th,
  a gated attention output, a gated shared expert). A vision-language model's text fields are
  read from `text_config`, its tower from `vision_config`; fields a published config leaves out
  take transformers' defaults (`DEFAULTS`), as vLLM reads configs through transformers.

`num_key_value_heads` defaults to the attention heads, `tie_word_embeddings` to false,
`max_position_embeddings` gives the context length. Weights count 2 bytes each (vLLM's dtype
"auto" serves fp32 checkpoints in 16 bits), 1 in a checkpoint quantized to fp8
(`quantization_config`, as DeepSeek-V3 ships); gpt-oss's MXFP4 experts 0.53125. What kvsim cannot
model is refused with a one-line error naming the field: an architecture not listed here, a
missing or malformed field, another quantization method. How a model whose layers differ is
placed in kvsim's one group of blocks is `sim.engine.layers.place`'s business.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvsim.sim.engine.catalog import ConfigError, ModelSpec, get_model

DENSE = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
MOE = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")  # their experts' fields are read (see below)
MLA = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")  # MLA, and experts from a dense start
# models whose layers differ: windows, chunks, linear attention (and experts), read below
MIXED = ("GptOssForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration",
         "Llama4ForConditionalGeneration", "Qwen3NextForCausalLM", "JambaForCausalLM", "NemotronHForCausalLM")
KNOWN = DENSE + MOE + MLA + MIXED
# fields whose presence means a model kvsim does not model, and what it is (checked on the
# families that never carry them: a Llama config with experts is another model)
NOT_YET = (
    ("num_local_experts", "a mixture of experts"), ("num_experts", "a mixture of experts"),
    ("n_routed_experts", "a mixture of experts"), ("kv_lora_rank", "multi-head latent attention (MLA)"),
    ("sliding_window_pattern", "interleaved sliding-window layers"),
    ("attention_chunk_size", "chunked local attention"), ("hybrid_override_pattern", "Mamba layers"),
    ("full_attention_interval", "linear-attention layers"),
)
# transformers' defaults for the fields a published config may leave out (its config classes,
# as vLLM reads the config through them); tests/sim/engine/test_hf_config.py checks each against
# the installed transformers
DEFAULTS: dict[str, dict[str, Any]] = {
    "Gemma3": {"vocab_size": 262208, "max_position_embeddings": 131072, "tie_word_embeddings": True,
               "sliding_window": 4096, "sliding_window_pattern": 6, "head_dim": 256, "attention_bias": False},
    "Llama4": {"no_rope_layer_interval": 4, "interleave_moe_layer_step": 1, "tie_word_embeddings": False},
    "Qwen3Next": {"attn_output_gate": True, "full_attention_interval": 4, "decoder_sparse_step": 1},
    "GptOss": {"tie_word_embeddings": False},
    "Jamba": {"attn_layer_period": 8, "attn_layer_offset": 4, "expert_layer_period": 2, "expert_layer_offset": 1,
              "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": 256, "mamba_conv_bias": True,
              "mamba_proj_bias": False, "tie_word_embeddings": False},
    "NemotronH": {"mamba_ssm_cache_dtype": "float32", "use_conv_bias": True, "use_bias": False, "mlp_bias": False,
                  "attention_bias": False, "tie_word_embeddings": False},
}


# Catalog models kept as their published config.json files (configs/SOURCES.md says where each
# was taken from), read like any other file
CONFIG_DIR = Path(__file__).parent / "configs"


def catalog_names() -> list[str]:
    """The catalog models kept as configs, by name (their files are read only when asked for)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def _positive(fields: dict[str, Any], where: str):
    """`need(field)`: `fields[field]` as a positive integer, or a ConfigError naming `where` and the field."""
    def need(field: str) -> int:
        v = fields.get(field)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ConfigError(f"{where}: field {field!r}: expected a positive integer, got {v!r}")
        return v

    return need


def model_spec(name: str) -> ModelSpec:
    """`--model`: a catalog name (`catalog.MODELS`, or a file of `CONFIG_DIR`),
    or the path of a config.json (or of the folder holding it)."""
    if is_config_path(name):
        return load_config(name)
    key = name.strip().lower()
    kept = CONFIG_DIR / f"{key}.json"
    if kept.is_file():
        spec = spec_from_config(json.loads(kept.read_text()), f"the catalog's {key}")
        return ModelSpec(**{**spec.__dict__, "name": key})
    try:
        return get_model(name)
    except ConfigError:
        from kvsim.sim.engine.catalog import MODELS

        raise ConfigError(f"unknown model {name!r}; choose from {', '.join([*MODELS, *catalog_names()])}, "
                          "or give the path of a config.json") from None


def read_from_config(name: str) -> bool:
    """Whether `model_spec(name)` reads a config (a file, or one the catalog keeps)."""
    key = name.strip().lower()
    return is_config_path(name) or (CONFIG_DIR / f"{key}.json").is_file()


def is_config_path(name: str) -> bool:
    """Whether a `--model` value names a config file rather than a catalog model."""
    return name.endswith(".json") or Path(name).is_dir() and (Path(name) / "config.json").is_file()


def load_config(name: str) -> ModelSpec:
    """The ModelSpec of the config file `name` (or of `name`/config.json); ConfigError naming the
    file and field for anything it cannot read or model."""
    path = Path(name) / "config.json" if Path(name).is_dir() else Path(name)
    try:
        cfg = json.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"model {name}: cannot read it ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not a JSON config ({e})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: not a JSON object")
    return spec_from_config(cfg, str(path))


def spec_from_config(cfg: dict[str, Any], source: str) -> ModelSpec:
    """See the module docstring; `source` names the file in errors."""
    arch = cfg.get("architectures")
    if not (isinstance(arch, list) and arch and isinstance(arch[0], str)):
        raise ConfigError(f"{source}: field 'architectures': missing (a list naming the model class)")
    kind = arch[0]
    if kind not in MIXED:
        for field, what in NOT_YET:
            if kind in MOE + MLA and what == "a mixture of experts" or kind in MLA and field == "kv_lora_rank":
                continue
            if cfg.get(field) not in (None, 0, [], False):
                raise ConfigError(f"{source}: field {field!r}: {kind} is {what}, which kvsim does not model yet "
                                  "(one attention type on every layer: " + ", ".join(DENSE + MOE + MLA) + ")")

    if kind not in KNOWN:
        raise ConfigError(f"{source}: field 'architectures': kvsim does not model {kind} yet "
                          f"(it reads {', '.join(KNOWN)})")
    family = next((f for f in DEFAULTS if kind.startswith(f)), "")
    encoder = 0
    if kind.endswith("ForConditionalGeneration"):  # a vision-language model: its text model, and a tower
        text, vision = cfg.get("text_config"), cfg.get("vision_config")
        for field, v in (("text_config", text), ("vision_config", vision)):
            if not isinstance(v, dict):
                raise ConfigError(f"{source}: field {field!r}: missing (an object of the {field[:-7]} model's fields)")
        text = {**DEFAULTS[family], **text}
        encoder = _vision_params(kind, vision, text, source)
        where = f"{source}: text_config"
    else:
        text, where = {**DEFAULTS.get(family, {}), **cfg}, source
    need = _positive(text, where)

    layers, hidden, heads = need("num_hidden_layers"), need("hidden_size"), need("num_attention_heads")
    kv_heads = need("num_key_value_heads") if text.get("num_key_value_heads") is not None else heads
    head_dim = need("head_dim") if text.get("head_dim") is not None else hidden // heads
    window, layer_types = _attention_layout(text, kind, layers, need, where)
    bias = bool(text.get("attention_bias") or text.get("bias"))
    experts = _experts(text, kind, layers, need)
    dense_mlp = "intermediate_size_mlp" if kind.startswith("Llama4") else "intermediate_size"
    spec = ModelSpec(
        name=str(cfg.get("_name_or_path") or Path(source).parent.name or Path(source).stem),
        num_params=0,
        num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        intermediate_size=need(dense_mlp), vocab_size=need("vocab_size"),
        max_model_len=need("max_position_embeddings"), sliding_window=window, layer_types=layer_types,
        attention_chunk_size=need("attention_chunk_size") if "chunked_attention" in layer_types else None,
        tied_embeddings=bool(text.get("tie_word_embeddings", False)),
        qkv_bias=True if kind == "Qwen2ForCausalLM" else bias,
        o_bias=bias and kind in ("LlamaForCausalLM", "MistralForCausalLM", "GptOssForCausalLM"),
        qk_norm=kind in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM") or family == "Gemma3",
        norms_per_layer=experts.pop("norms_per_layer", 4 if family == "Gemma3" else 2),
        attention_sinks=kind == "GptOssForCausalLM",
        attn_output_gate=kind == "Qwen3NextForCausalLM" and bool(text.get("attn_output_gate")),
        weight_dtype_bytes=_weight_bytes(cfg, source) if kind != "GptOssForCausalLM" else None,
        expert_weight_bytes=_mxfp4(cfg, source) if kind == "GptOssForCausalLM" else None,
        encoder_params=encoder,
        **experts,
    )
    return ModelSpec(**{**spec.__dict__, "num_params": spec.count_params()})


def _attention_layout(text: dict[str, Any], kind: str, layers: int, need: Any, where: str) -> tuple[int | None, tuple[str, ...]]:
    """(the window of the sliding layers, each layer's type; () when all are alike), as each
    model file of vLLM 0.33 decides a layer's attention:

    - llama.py, mistral.py: `sliding_window` on every layer (kvsim's uniform case); a
      `layer_types` list with "sliding_attention" entries puts it on those only;
    - qwen2.py: a window only with `use_sliding_window`, and only on every layer;
    - gpt_oss.py: `sliding_window` on the even layers (layer_idx % 2 == 0), whatever else;
    - gemma3.py: `layer_types` (transformers fills it in from `sliding_window_pattern`: layer i
      is full attention iff (i + 1) % pattern == 0);
    - llama4.py: layer i is chunked-local (`attention_chunk_size`) unless `no_rope_layers[i]` is
      0, which marks a NoPE layer of full attention (transformers fills the list in: a NoPE layer
      every `no_rope_layer_interval`-th layer);
    - qwen3_next.py: `layer_types` (transformers fills it in from `full_attention_interval`:
      layer i is full attention iff (i + 1) % interval == 0, the others gated-delta-net).
    """
    if kind in ("MistralForCausalLM", "LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen2ForCausalLM"):
        listed = text.get("layer_types")
        if listed:
            types = _layer_types(listed, layers, where, ("full_attention", "sliding_attention"))
            if "sliding_attention" in types and kind in ("LlamaForCausalLM", "MistralForCausalLM"):
                return need("sliding_window"), types if len(set(types)) > 1 else ()
            if "sliding_attention" in types and len(set(types)) > 1:
                raise ConfigError(f"{where}: field 'layer_types': sliding-window and full-attention layers mixed, "
                                  f"which vLLM's {kind} does not run")
        if kind == "Qwen2ForCausalLM":
            if not text.get("use_sliding_window"):
                return None, ()
            if text.get("max_window_layers", layers) < layers:
                raise ConfigError(f"{where}: field 'max_window_layers': sliding-window and full-attention layers "
                                  "mixed, which vLLM's Qwen2ForCausalLM does not run")
            return need("sliding_window"), ()
        if kind == "Qwen3ForCausalLM" and not text.get("use_sliding_window"):
            return None, ()
        return (need("sliding_window") if text.get("sliding_window") is not None else None), ()
    if kind in MOE + MLA:
        return None, ()
    if kind == "GptOssForCausalLM":
        types = tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers))
        return need("sliding_window"), types
    if kind.startswith("Gemma3"):
        listed = text.get("layer_types")
        if listed:
            types = _layer_types(listed, layers, where, ("full_attention", "sliding_attention"))
        else:
            pattern = need("sliding_window_pattern")
            types = tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers))
        return need("sliding_window"), types
    if kind.startswith("Llama4"):
        nope = text.get("no_rope_layers") or [int((i + 1) % need("no_rope_layer_interval") != 0) for i in range(layers)]
        if not isinstance(nope, list) or len(nope) != layers:
            raise ConfigError(f"{where}: field 'no_rope_layers': expected a list of {layers} flags, got {nope!r}")
        chunked = "chunked_attention" if text.get("attention_chunk_size") else "full_attention"
        return None, tuple("full_attention" if flag == 0 else chunked for flag in nope)
    if kind == "JambaForCausalLM":  # jamba.py layers_block_type: attention iff i % period == offset
        period, offset = need("attn_layer_period"), text.get("attn_layer_offset", 0)
        return None, tuple("full_attention" if i % period == offset else "linear_attention" for i in range(layers))
    if kind == "NemotronHForCausalLM":  # nemotron_h.py: one character a layer of hybrid_override_pattern
        pattern = text.get("hybrid_override_pattern")
        names = {"M": "linear_attention", "*": "full_attention", "-": "mlp"}
        if not isinstance(pattern, str) or len(pattern) != layers:
            raise ConfigError(f"{where}: field 'hybrid_override_pattern': expected {layers} characters, got {pattern!r}")
        bad = next((c for c in pattern if c not in names), None)
        if bad is not None:
            what = "a mixture-of-experts layer (E), not modelled yet" if bad == "E" else "not a layer kvsim knows"
            raise ConfigError(f"{where}: field 'hybrid_override_pattern': {bad!r} is {what} (M, *, -)")
        return None, tuple(names[c] for c in pattern)
    # Qwen3-Next
    listed = text.get("layer_types")
    if listed:
        return None, _layer_types(listed, layers, where, ("full_attention", "linear_attention"))
    interval = need("full_attention_interval")
    return None, tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers))


def _layer_types(listed: Any, layers: int, where: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    """A config's `layer_types`, checked: one known name a layer."""
    if not isinstance(listed, list) or len(listed) != layers:
        raise ConfigError(f"{where}: field 'layer_types': expected a list of {layers} layer types, got "
                          f"{len(listed) if isinstance(listed, list) else repr(listed)}")
    for i, t in enumerate(listed):
        if t not in allowed:
            raise ConfigError(f"{where}: field 'layer_types': layer {i} is {t!r}; this model's layers are "
                              + " or ".join(allowed))
    return tuple(listed)


def _vision_params(kind: str, vision: dict[str, Any], text: dict[str, Any], source: str) -> int:
    """The vision tower's and projector's parameters, which vLLM loads with the model:

    - Gemma 3 (gemma3_mm.py, siglip.py): a SigLIP encoder (conv patch embedding with bias, a
      position embedding per patch, per layer two LayerNorms, q/k/v/o and a two-layer MLP with
      biases, a final LayerNorm) and the projector's (vision x text) matrix and RMSNorm;
    - Llama 4 (mllama4.py): the unfold patch embedding (no bias), a class and a position
      embedding per patch + 1, two LayerNorms, per layer the same encoder block, the
      pixel-shuffle MLP and the projector to the text width (no biases where the config says).
    """
    need = _positive(vision, f"{source}: vision_config")

    d, inner, n = need("hidden_size"), need("intermediate_size"), need("num_hidden_layers")
    patch, image = need("patch_size"), need("image_size")
    channels = vision.get("num_channels", 3)
    block = 4 * d * d + 4 * d + 2 * d * inner + inner + d + 2 * 2 * d  # attention, MLP, two LayerNorms
    patches = (image // patch) ** 2
    if kind.startswith("Gemma3"):
        if vision.get("vision_use_head"):
            raise ConfigError(f"{source}: vision_config: field 'vision_use_head': a pooling head is not modelled")
        tower = channels * patch * patch * d + d + patches * d + n * block + 2 * d
        return tower + d * text["hidden_size"] + d
    out, proj_in, proj_out = need("vision_output_dim"), need("projector_input_dim"), need("projector_output_dim")
    bias = bool(vision.get("multi_modal_projector_bias"))
    tower = channels * patch * patch * d + d + (patches + 1) * d + 2 * 2 * d + n * block
    shuffle = inner * proj_in + proj_in * proj_out + ((proj_in + proj_out) if bias else 0)
    return tower + shuffle + out * text["hidden_size"]


def _weight_bytes(cfg: dict[str, Any], source: str) -> int | None:
    """A quantized checkpoint's bytes a weight: `quantization_config.quant_method` fp8 (as
    DeepSeek-V3 ships) is 1; none is the model dtype's (None); another method is refused."""
    q = cfg.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method == "fp8":
        return 1
    raise ConfigError(f"{source}: field 'quantization_config': quant_method {method!r} is not modelled "
                      "(fp8, or none)")


def _mxfp4(cfg: dict[str, Any], source: str) -> float | None:
    """gpt-oss ships its experts in MXFP4 (`quantization_config.quant_method` "mxfp4"; attention,
    router, embeddings and head are left out of it, `modules_to_not_convert`): 4 bits a weight and
    one 8-bit scale a block of 32 (vLLM's mxfp4 MoE keeps them so), 0.53125 bytes a weight."""
    q = cfg.get("quantization_config")
    if not q:
        return None
    if isinstance(q, dict) and q.get("quant_method") == "mxfp4":
        return 0.5 + 1 / 32
    raise ConfigError(f"{source}: field 'quantization_config': quant_method {q.get('quant_method') if isinstance(q, dict) else q!r} "
                      "is not modelled for gpt-oss (mxfp4, or none)")


def _experts(cfg: dict[str, Any], kind: str, layers: int, need: Any) -> dict[str, int]:
    """A mixture of experts' fields, as vLLM 0.33 reads them: Mixtral (mixtral.py) puts
    `num_local_experts` experts of `intermediate_size` on every layer; Qwen3-MoE (qwen3_moe.py)
    puts `num_experts` of `moe_intermediate_size` on layer i unless i is in `mlp_only_layers` or
    (i + 1) is not a multiple of `decoder_sparse_step` (those keep a dense MLP of
    `intermediate_size`); `num_experts_per_tok` of them serve each token."""
    if kind == "MixtralForCausalLM":
        return {"num_experts": need("num_local_experts"), "experts_per_token": need("num_experts_per_tok"),
                "moe_intermediate_size": need("intermediate_size"), "moe_layers": layers}
    if kind in MLA:  # deepseek_v2.py: layer i is MoE from first_k_dense_replace on, every moe_layer_freq-th
        first = cfg.get("first_k_dense_replace") or 0
        freq = cfg.get("moe_layer_freq") or 1
        q_lora = cfg.get("q_lora_rank")
        return {"num_experts": need("n_routed_experts"), "experts_per_token": need("num_experts_per_tok"),
                "moe_intermediate_size": need("moe_intermediate_size"),
                "moe_layers": sum(1 for i in range(layers) if i >= first and i % freq == 0),
                "shared_experts": cfg.get("n_shared_experts") or 0,
                "router_bias": cfg.get("topk_method") == "noaux_tc",
                "kv_lora_rank": need("kv_lora_rank"), "q_lora_rank": need("q_lora_rank") if q_lora else 0,
                "qk_nope_head_dim": need("qk_nope_head_dim"), "qk_rope_head_dim": need("qk_rope_head_dim"),
                "v_head_dim": need("v_head_dim")}
    if kind == "GptOssForCausalLM":  # gpt_oss.py: experts of intermediate_size on every layer, with biases
        return {"num_experts": need("num_local_experts"), "experts_per_token": need("num_experts_per_tok"),
                "moe_intermediate_size": need("intermediate_size"), "moe_layers": layers,
                "router_bias": True, "expert_bias": True}
    if kind.startswith("Llama4"):  # llama4.py: MoE on layer i iff (i + 1) % interleave_moe_layer_step == 0,
        # with one shared expert of intermediate_size; the other layers a dense MLP of intermediate_size_mlp
        step = cfg.get("interleave_moe_layer_step") or 0
        moe = sum(1 for i in range(layers) if step > 0 and (i + 1) % step == 0)
        return {"num_experts": need("num_local_experts"), "experts_per_token": need("num_experts_per_tok"),
                "moe_intermediate_size": need("intermediate_size"), "moe_layers": moe,
                "shared_expert_intermediate_size": need("intermediate_size")}
    if kind == "Qwen3NextForCausalLM":  # qwen3_next.py: Qwen3-MoE's layout, a gated shared expert
        only = cfg.get("mlp_only_layers") or []
        step = need("decoder_sparse_step")
        moe = sum(1 for i in range(layers) if i not in only and (i + 1) % step == 0)
        shared = cfg.get("shared_expert_intermediate_size") or 0
        return {"num_experts": need("num_experts"), "experts_per_token": need("num_experts_per_tok"),
                "moe_intermediate_size": need("moe_intermediate_size"), "moe_layers": moe,
                "shared_expert_intermediate_size": shared, "shared_expert_gate": shared > 0,
                "linear_key_heads": need("linear_num_key_heads"), "linear_value_heads": need("linear_num_value_heads"),
                "linear_key_head_dim": need("linear_key_head_dim"),
                "linear_value_head_dim": need("linear_value_head_dim"),
                "linear_conv_kernel": need("linear_conv_kernel_dim")}
    if kind == "JambaForCausalLM":  # jamba.py: experts on i % expert_layer_period == offset; Mamba1 mixers
        period, offset = need("expert_layer_period"), cfg.get("expert_layer_offset", 0)
        rank = cfg.get("mamba_dt_rank")
        hidden = need("hidden_size")
        return {"num_experts": need("num_experts"), "experts_per_token": need("num_experts_per_tok"),
                "moe_intermediate_size": need("intermediate_size"),
                "moe_layers": sum(1 for i in range(layers) if i % period == offset),
                "linear_kind": "mamba1", "ssm_state_size": need("mamba_d_state"), "linear_conv_kernel": need("mamba_d_conv"),
                "mamba_intermediate": need("mamba_expand") * hidden,
                "mamba_dt_rank": -(-hidden // 16) if rank == "auto" else need("mamba_dt_rank"),
                "mamba_conv_bias": bool(cfg.get("mamba_conv_bias"))}
    if kind == "NemotronHForCausalLM":  # nemotron_h.py: Mamba2 mixers; relu^2 MLPs; a layer is one of them
        dtype = cfg.get("mamba_ssm_cache_dtype")
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"config: field 'mamba_ssm_cache_dtype': {dtype!r} (float32, bfloat16 or float16)")
        return {"linear_kind": "mamba2", "ssm_state_size": need("ssm_state_size"), "linear_conv_kernel": need("conv_kernel"),
                "mamba_heads": need("mamba_num_heads"), "mamba_head_dim": need("mamba_head_dim"),
                "mamba_groups": need("n_groups"), "mamba_conv_bias": bool(cfg.get("use_conv_bias")),
                "state_dtype_bytes": 4 if dtype == "float32" else 2, "separate_ffn_layers": True, "gated_mlp": False,
                "norms_per_layer": 1}
    if kind == "Qwen3MoeForCausalLM":
        only = cfg.get("mlp_only_layers") or []
        step = need("decoder_sparse_step") if cfg.get("decoder_sparse_step") is not None else 1
        moe = sum(1 for i in range(layers) if i not in only and (i + 1) % step == 0)
        return {"num_experts": need("num_experts"), "experts_per_token": need("num_experts_per_tok"),
                "moe_intermediate_size": need("moe_intermediate_size"), "moe_layers": moe}
    return {}
