"""A model from its Hugging Face `config.json`, read the way vLLM 0.33's model files read it.

`--model path/to/config.json` (offline: the file only, no hub, no weights). This first step
takes the dense decoder families vLLM runs through its Llama-style implementations, each with
one attention type on every layer:

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
  only for speculative decoding.

`num_key_value_heads` defaults to the attention heads, `tie_word_embeddings` to false,
`max_position_embeddings` gives the context length. Weights count 2 bytes each (vLLM's dtype
"auto" serves fp32 checkpoints in 16 bits), 1 in a checkpoint quantized to fp8
(`quantization_config`, as DeepSeek-V3 ships). What this step cannot model yet is refused with a
one-line error naming the field: other mixtures of experts and MLA models, and models that mix layer types
(sliding-window or chunked-local with full attention, linear attention, Mamba), which need the
per-layer KV groups of vLLM's hybrid cache manager.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvsim.sim.engine.catalog import ConfigError, ModelSpec, get_model

DENSE = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
MOE = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")  # their experts' fields are read (see below)
MLA = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")  # MLA, and experts from a dense start
# fields whose presence means a model this step does not model, and what it is
NOT_YET = (
    ("num_local_experts", "a mixture of experts"), ("num_experts", "a mixture of experts"),
    ("n_routed_experts", "a mixture of experts"), ("kv_lora_rank", "multi-head latent attention (MLA)"),
    ("layer_types", "per-layer attention types"), ("sliding_window_pattern", "interleaved sliding-window layers"),
    ("attention_chunk_size", "chunked local attention"), ("hybrid_override_pattern", "Mamba layers"),
    ("full_attention_interval", "linear-attention layers"),
)


# Catalog models kept as their config.json fields (the Hugging Face repos named), read like a file
CONFIGS: dict[str, dict[str, Any]] = {
    # Qwen/Qwen3-8B
    "qwen3-8b": {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096, "intermediate_size": 12288,
                 "max_position_embeddings": 40960, "num_attention_heads": 32, "num_hidden_layers": 36,
                 "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False,
                 "attention_bias": False},
    # mistralai/Mixtral-8x7B-v0.1
    "mixtral-8x7b": {"architectures": ["MixtralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
                     "max_position_embeddings": 32768, "num_attention_heads": 32, "num_hidden_layers": 32,
                     "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000,
                     "tie_word_embeddings": False},
    # Qwen/Qwen3-30B-A3B
    "qwen3-30b-a3b": {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 6144,
                      "moe_intermediate_size": 768, "max_position_embeddings": 40960, "num_attention_heads": 32,
                      "num_hidden_layers": 48, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                      "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
                      "vocab_size": 151936, "tie_word_embeddings": False},
    # deepseek-ai/DeepSeek-V3
    "deepseek-v3": {"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168, "intermediate_size": 18432,
                    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
                    "num_key_value_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1,
                    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "moe_layer_freq": 1, "kv_lora_rank": 512,
                    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                    "vocab_size": 129280, "max_position_embeddings": 163840, "tie_word_embeddings": False,
                    "topk_method": "noaux_tc", "num_nextn_predict_layers": 1,
                    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}},
}


def model_spec(name: str) -> ModelSpec:
    """`--model`: a catalog name (`catalog.MODELS`, or one of `CONFIGS`), or the path of a
    config.json (or of the folder holding it)."""
    if is_config_path(name):
        return load_config(name)
    key = name.strip().lower()
    if key in CONFIGS:
        spec = spec_from_config(CONFIGS[key], f"the catalog's {key}")
        return ModelSpec(**{**spec.__dict__, "name": key})
    return get_model(name)


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
    for field, what in NOT_YET:
        if kind in MOE + MLA and what == "a mixture of experts" or kind in MLA and field == "kv_lora_rank":
            continue
        if cfg.get(field) not in (None, 0, [], False):
            raise ConfigError(f"{source}: field {field!r}: {kind} is {what}, which kvsim does not model yet "
                              "(one attention type on every layer: " + ", ".join(DENSE + MOE + MLA) + ")")
    if kind not in DENSE + MOE + MLA:
        raise ConfigError(f"{source}: field 'architectures': kvsim does not model {kind} yet "
                          f"(it reads {', '.join(DENSE + MOE + MLA)})")

    def need(field: str) -> int:
        v = cfg.get(field)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ConfigError(f"{source}: field {field!r}: expected a positive integer, got {v!r}")
        return v

    layers, hidden, heads = need("num_hidden_layers"), need("hidden_size"), need("num_attention_heads")
    kv_heads = need("num_key_value_heads") if cfg.get("num_key_value_heads") is not None else heads
    head_dim = need("head_dim") if cfg.get("head_dim") is not None else hidden // heads
    window = None
    if kind in ("MistralForCausalLM", "LlamaForCausalLM") and cfg.get("sliding_window") is not None:
        window = need("sliding_window")
    if kind == "Qwen2ForCausalLM" and cfg.get("use_sliding_window"):
        window = need("sliding_window")
        if cfg.get("max_window_layers", layers) < layers:
            raise ConfigError(f"{source}: field 'max_window_layers': sliding-window and full-attention layers "
                              "mixed, which needs vLLM's hybrid KV groups (not modelled yet)")
    bias = bool(cfg.get("attention_bias") or cfg.get("bias"))
    experts = _experts(cfg, kind, layers, need)
    spec = ModelSpec(
        name=str(cfg.get("_name_or_path") or Path(source).parent.name or Path(source).stem),
        num_params=0,
        num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        intermediate_size=need("intermediate_size"), vocab_size=need("vocab_size"),
        max_model_len=need("max_position_embeddings"), sliding_window=window,
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=True if kind == "Qwen2ForCausalLM" else bias,
        o_bias=bias and kind in ("LlamaForCausalLM", "MistralForCausalLM"),
        qk_norm=kind in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        weight_dtype_bytes=_weight_bytes(cfg, source),
        **experts,
    )
    return ModelSpec(**{**spec.__dict__, "num_params": spec.count_params()})


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
    if kind == "Qwen3MoeForCausalLM":
        only = cfg.get("mlp_only_layers") or []
        step = need("decoder_sparse_step") if cfg.get("decoder_sparse_step") is not None else 1
        moe = sum(1 for i in range(layers) if i not in only and (i + 1) % step == 0)
        return {"num_experts": need("num_experts"), "experts_per_token": need("num_experts_per_tok"),
                "moe_intermediate_size": need("moe_intermediate_size"), "moe_layers": moe}
    return {}
