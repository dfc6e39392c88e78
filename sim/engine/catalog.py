"""Models and GPUs the cost model knows, with their published numbers.

Model shapes are the fields of each model's Hugging Face `config.json`;
parameter counts are the safetensors totals (and equal `ModelSpec.count_params()`).
GPU numbers are the vendor datasheets' (dense bf16, no sparsity); memory is the
total the driver reports (`nvidia-smi --query-gpu=memory.total`), which is what
vLLM's memory profiler starts from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

MiB = 1 << 20
# a layer's attention, as vLLM's model files and transformers' configs name them
LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "linear_attention", "mlp", "moe")
ATTENTION_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


class ConfigError(ValueError):
    """A bad configuration value (an unknown model or GPU name, say); the message names the
    field and the value. `sim.engine.config` hands it on; the catalog, lowest of the
    engine's modules, defines it so that neither imports the other in a circle."""


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer's shape, as far as memory and FLOPs need it."""

    name: str
    num_params: int
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_model_len: int
    dtype_bytes: int = 2
    sliding_window: int | None = None
    weight_dtype_bytes: int | None = None  # a quantized checkpoint's bytes a weight (fp8: 1); None: dtype_bytes
    tied_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False  # a bias on the attention output too (Llama's attention_bias)
    qk_norm: bool = False  # RMSNorm of q and k per head (Qwen3)
    # a mixture of experts: `moe_layers` of the layers hold `num_experts` gated MLPs of
    # `moe_intermediate_size` (and a router), of which each token uses `experts_per_token`; the
    # other layers keep the dense MLP of `intermediate_size`
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    moe_layers: int = 0
    shared_experts: int = 0  # experts every token uses too (DeepSeek's n_shared_experts)
    router_bias: bool = False  # DeepSeek-V3's e_score_correction_bias (topk_method "noaux_tc")
    # multi-head latent attention (DeepSeek): K and V come from one cached latent of kv_lora_rank
    # plus a shared rotary key of qk_rope_head_dim, per token and layer
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # per-layer attention (vLLM's names, `LAYER_TYPES`); empty: every layer alike (full attention,
    # or `sliding_window` on every layer as Mistral has it)
    layer_types: tuple[str, ...] = ()
    attention_chunk_size: int | None = None  # the chunk of "chunked_attention" layers (Llama 4)
    attention_sinks: bool = False  # a learned sink logit per head (gpt-oss)
    attn_output_gate: bool = False  # q_proj also yields a sigmoid gate on the output (Qwen3-Next)
    norms_per_layer: int = 2  # RMSNorms of hidden_size a layer (Gemma 3: 4)
    expert_bias: bool = False  # biases on the experts' projections (gpt-oss)
    shared_expert_intermediate_size: int = 0  # one shared expert of this size (Qwen3-Next, Llama 4)
    shared_expert_gate: bool = False  # a sigmoid gate on the shared expert's output (Qwen3-Next)
    expert_weight_bytes: float | None = None  # the experts' bytes a weight when only they are quantized
    # gated-delta-net linear attention (Qwen3-Next's "linear_attention" layers): its recurrent state
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0
    encoder_params: int = 0  # a vision tower and its projector: held in memory, not run on text
    # the state-space layers' kind: "gated_delta_net" (the linear_* fields), "mamba2" or "mamba1"
    linear_kind: str = "gated_delta_net"
    ssm_state_size: int = 0  # Mamba's N
    mamba_heads: int = 0  # Mamba2's heads (of mamba_head_dim) and groups of B and C
    mamba_head_dim: int = 0
    mamba_groups: int = 0
    mamba_intermediate: int = 0  # Mamba1's expanded width (mamba_expand x hidden)
    mamba_dt_rank: int = 0
    mamba_conv_bias: bool = True
    state_dtype_bytes: int | None = None  # the recurrent state's element (NemotronH: fp32); None: the model's
    # layers that are one block each, a mixer or a feed-forward (Nemotron-H's "mlp" and "moe" layer
    # types), rather than a mixer and a feed-forward in every layer
    separate_ffn_layers: bool = False
    gated_mlp: bool = True  # the dense MLP's gate (Nemotron-H's relu^2 MLP has none: up and down only)

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    def layer_type(self, i: int) -> str:
        """Layer i's attention, one of `LAYER_TYPES`."""
        if self.layer_types:
            return self.layer_types[i]
        return "sliding_attention" if self.sliding_window else "full_attention"

    def count_layer_types(self) -> dict[str, int]:
        """Layers of each type, in order of first appearance."""
        counts: dict[str, int] = {}
        for i in range(self.num_layers):
            t = self.layer_type(i)
            counts[t] = counts.get(t, 0) + 1
        return counts

    def kv_elements_per_token_layer(self, tp: int = 1) -> int:
        """Elements one token keeps in one layer's cache on one rank: K and V of its KV heads
        (split across ranks, replicated when fewer than ranks), or MLA's latent and rotary key
        (vLLM's MLAAttentionSpec: one "head" of kv_lora_rank + qk_rope_head_dim, on every rank)."""
        if self.mla:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * max(1, self.num_kv_heads // tp) * self.head_dim

    def _attention(self) -> int:
        """One full-attention layer's parameters (a sliding-window or chunked one has the same)."""
        h = self.hidden_size
        if self.mla:  # vLLM deepseek_v2.py's projections (q through a LoRA when q_lora_rank is set)
            heads, qk = self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim
            q_lora = self.q_lora_rank
            q = h * q_lora + q_lora + q_lora * heads * qk if q_lora else h * heads * qk
            kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank + \
                self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
            return q + kv + heads * self.v_head_dim * h
        kv = self.num_kv_heads * self.head_dim
        q = self.num_heads * self.head_dim
        gate = q if self.attn_output_gate else 0
        attn = h * (q + gate) + 2 * h * kv + q * h + ((q + gate + 2 * kv) if self.qkv_bias else 0)
        attn += self.num_heads if self.attention_sinks else 0
        return attn + (h if self.o_bias else 0) + (2 * self.head_dim if self.qk_norm else 0)

    def _linear_attention(self) -> int:
        """One gated-delta-net layer's parameters (vLLM qwen_gdn_linear_attn.py): q, k, v and the
        output gate z from one projection, the decay and beta gates, a causal conv over q, k and v,
        the decay's A and dt bias per value head, a gated RMSNorm of the value head, out_proj."""
        h = self.hidden_size
        key, value = self.linear_key_heads * self.linear_key_head_dim, self.linear_value_heads * self.linear_value_head_dim
        conv = 2 * key + value
        return (h * (2 * key + 2 * value) + h * 2 * self.linear_value_heads + conv * self.linear_conv_kernel
                + 2 * self.linear_value_heads + self.linear_value_head_dim + value * h)

    def _mamba(self) -> int:
        """One Mamba layer's parameters: Mamba2 (vLLM mamba_mixer2.py MambaMixer2) projects to z, x,
        B, C and dt, convolves x, B and C, keeps A, D and a dt bias per head and a gated norm of
        the width; Mamba1 (mamba_mixer.py MambaMixer, with Jamba's RMS norms of dt, B and C)
        projects to x and z, convolves x, projects x to dt, B and C and dt up to the width."""
        h, n, k = self.hidden_size, self.ssm_state_size, self.linear_conv_kernel
        if self.linear_kind == "mamba2":
            width, heads = self.mamba_heads * self.mamba_head_dim, self.mamba_heads
            conv = width + 2 * self.mamba_groups * n
            return (h * (width + conv + heads) + conv * k + (conv if self.mamba_conv_bias else 0)
                    + 3 * heads + width + width * h)
        width, rank = self.mamba_intermediate, self.mamba_dt_rank
        return (h * 2 * width + width * k + (width if self.mamba_conv_bias else 0) + width * (rank + 2 * n)
                + rank * width + width + width * n + width + width * h + rank + 2 * n)

    def linear_state_shapes(self, tp: int = 1) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """A state-space layer's state per sequence on one rank (vLLM mamba_utils.py
        MambaStateShapeCalculator): the conv state and the recurrent state.

        - gated delta net: (conv_dim / tp, kernel - 1) and (value heads / tp, value head dim, key
          head dim), conv_dim = 2 x key heads x key dim + value heads x value dim;
        - Mamba2: ((width + 2 x groups x N) / tp, kernel - 1) and (heads / tp, head dim, N), groups
          raised to tp when tp does not divide them (`extra_groups_for_head_shards`);
        - Mamba1: (width / tp, kernel - 1) and (width / tp, N)."""
        k = self.linear_conv_kernel - 1
        if self.linear_kind == "mamba2":
            groups = self.mamba_groups + (0 if self.mamba_groups % tp == 0 else tp - self.mamba_groups)
            conv = self.mamba_heads * self.mamba_head_dim + 2 * groups * self.ssm_state_size
            return (conv // tp, k), (self.mamba_heads // tp, self.mamba_head_dim, self.ssm_state_size)
        if self.linear_kind == "mamba1":
            return (self.mamba_intermediate // tp, k), (self.mamba_intermediate // tp, self.ssm_state_size)
        conv = 2 * self.linear_key_heads * self.linear_key_head_dim + self.linear_value_heads * self.linear_value_head_dim
        return ((conv // tp, k), (self.linear_value_heads // tp, self.linear_value_head_dim, self.linear_key_head_dim))

    def state_flops_per_token(self, tp: int = 1) -> float:
        """FLOPs one token's recurrence costs in one state-space layer on one rank: about 4 an
        element of the recurrent state (decay, update, read-out)."""
        shape = self.linear_state_shapes(tp)[1]
        n = 1
        for d in shape:
            n *= d
        return 4.0 * n

    def expert_params(self) -> int:
        """One expert's parameters (a gated MLP, with gpt-oss's biases)."""
        bias = 2 * self.moe_intermediate_size + self.hidden_size if self.expert_bias else 0
        return 3 * self.hidden_size * self.moe_intermediate_size + bias

    def count_params(self) -> int:
        """Parameters from the shape (Llama-style: gated MLP, RMSNorm, no other biases; a MoE
        layer holds every expert, its shared experts and a router), and `encoder_params`."""
        h = self.hidden_size
        dense = self.num_layers - self.moe_layers
        moe = (self.num_experts + self.shared_experts) * self.expert_params() + h * self.num_experts
        moe += self.num_experts if self.router_bias else 0
        moe += 3 * h * self.shared_expert_intermediate_size + (h if self.shared_expert_gate else 0)
        types = [self.layer_type(i) for i in range(self.num_layers)]
        linear = types.count("linear_attention")
        attention = sum(1 for t in types if t in ATTENTION_TYPES) * self._attention()
        attention += linear * (self._linear_attention() if self.linear_kind == "gated_delta_net" else self._mamba())
        if self.separate_ffn_layers:  # Nemotron-H: a layer is a mixer or a feed-forward
            dense = types.count("mlp")
        mlp = (3 if self.gated_mlp else 2) * h * self.intermediate_size
        layers = attention + self.num_layers * self.norms_per_layer * h + dense * mlp
        embed = self.vocab_size * h * (1 if self.tied_embeddings else 2)
        return layers + self.moe_layers * moe + embed + h + self.encoder_params

    def unused_expert_params(self) -> int:
        """The parameters of the experts one token does not pick, over every MoE layer."""
        return self.moe_layers * (self.num_experts - self.experts_per_token) * self.expert_params()

    def active_params(self) -> int:
        """Parameters one text token's forward uses: every expert a token does not pick, and any
        vision tower, are left out."""
        return self.num_params - self.unused_expert_params() - self.encoder_params


@dataclass(frozen=True)
class GpuSpec:
    """One GPU's peak rates (bytes and FLOPs per second) and memory."""

    name: str
    peak_flops: float  # dense bf16 tensor-core FLOP/s
    hbm_bw: float  # device memory bandwidth, bytes/s
    memory_bytes: int  # total device memory as the driver reports it
    pcie_bw: float  # effective host <-> device bandwidth, one direction, bytes/s
    nvlink_bw: float | None  # GPU <-> GPU bandwidth, one direction, bytes/s; None: over PCIe


MODELS: dict[str, ModelSpec] = {
    # meta-llama/Meta-Llama-3-8B config.json; 8,030,261,248 params
    "llama-3-8b": ModelSpec(
        name="llama-3-8b", num_params=8_030_261_248, num_layers=32, hidden_size=4096,
        num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336,
        vocab_size=128256, max_model_len=8192,
    ),
    # meta-llama/Meta-Llama-3-70B config.json; 70,553,706,496 params
    "llama-3-70b": ModelSpec(
        name="llama-3-70b", num_params=70_553_706_496, num_layers=80, hidden_size=8192,
        num_heads=64, num_kv_heads=8, head_dim=128, intermediate_size=28672,
        vocab_size=128256, max_model_len=8192,
    ),
    # Qwen/Qwen2.5-7B config.json (use_sliding_window: false; q/k/v biases); 7,615,616,512 params
    "qwen2.5-7b": ModelSpec(
        name="qwen2.5-7b", num_params=7_615_616_512, num_layers=28, hidden_size=3584,
        num_heads=28, num_kv_heads=4, head_dim=128, intermediate_size=18944,
        vocab_size=152064, max_model_len=131072, qkv_bias=True,
    ),
    # mistralai/Mistral-7B-v0.1 config.json (sliding_window: 4096); 7,241,732,096 params
    "mistral-7b": ModelSpec(
        name="mistral-7b", num_params=7_241_732_096, num_layers=32, hidden_size=4096,
        num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336,
        vocab_size=32000, max_model_len=32768, sliding_window=4096,
    ),
}  # fmt: skip

GPUS: dict[str, GpuSpec] = {
    # NVIDIA A100 datasheet (SXM4 80GB): 312 TFLOP/s bf16 dense, 2,039 GB/s HBM2e,
    # NVLink 3 600 GB/s (300 per direction); PCIe gen4 x16, ~25 GB/s effective; 81920 MiB
    "a100-80g": GpuSpec("a100-80g", 312e12, 2.039e12, 81920 * MiB, 25e9, 300e9),
    # NVIDIA H100 datasheet (SXM5): 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3,
    # NVLink 4 900 GB/s (450 per direction); PCIe gen5 x16, ~50 GB/s effective; 81559 MiB
    "h100-sxm": GpuSpec("h100-sxm", 989e12, 3.35e12, 81559 * MiB, 50e9, 450e9),
    # NVIDIA H200 datasheet (SXM): 989 TFLOP/s bf16 dense, 4.8 TB/s HBM3e, 141 GB,
    # NVLink 4 900 GB/s (450 per direction); PCIe gen5 x16, ~50 GB/s effective; 143771 MiB
    "h200": GpuSpec("h200", 989e12, 4.8e12, 143771 * MiB, 50e9, 450e9),
    # NVIDIA L40S datasheet: 362.05 TFLOP/s bf16 dense, 864 GB/s GDDR6, 48 GB,
    # no NVLink (GPU <-> GPU over PCIe); PCIe gen4 x16, ~25 GB/s effective; 46068 MiB
    "l40s": GpuSpec("l40s", 362.05e12, 0.864e12, 46068 * MiB, 25e9, None),
    # NVIDIA HGX B200 datasheet (1,000 W): 2,250 TFLOP/s bf16 dense (4,500 with sparsity), 8 TB/s
    # HBM3e, 180 GB; NVLink 5 1.8 TB/s (900 GB/s per direction); PCIe gen5 to the host, ~50 GB/s
    # effective; 183359 MiB as nvidia-smi reports it
    "b200": GpuSpec("b200", 2250e12, 8.0e12, 183359 * MiB, 50e9, 900e9),
    # AMD Instinct MI300X datasheet: 1,307.4 TFLOP/s bf16 dense, 5.3 TB/s HBM3, 192 GB; Infinity
    # Fabric 7 links x 64 GB/s per direction to the other GPUs (448 GB/s); PCIe gen5 x16, ~50 GB/s
    # effective; 192 GB as the datasheet gives it (the driver's figure may be a little lower)
    "mi300x": GpuSpec("mi300x", 1307.4e12, 5.3e12, 192 * 10**9, 50e9, 448e9),
}

_MODEL_ALIASES = {
    "meta-llama-3-8b": "llama-3-8b",
    "meta-llama/meta-llama-3-8b": "llama-3-8b",
    "meta-llama/meta-llama-3-8b-instruct": "llama-3-8b",
    "llama3-8b": "llama-3-8b",
    "meta-llama-3-70b": "llama-3-70b",
    "meta-llama/meta-llama-3-70b": "llama-3-70b",
    "meta-llama/meta-llama-3-70b-instruct": "llama-3-70b",
    "llama3-70b": "llama-3-70b",
    "qwen/qwen2.5-7b": "qwen2.5-7b",
    "qwen/qwen2.5-7b-instruct": "qwen2.5-7b",
    "mistralai/mistral-7b-v0.1": "mistral-7b",
    "mistral-7b-v0.1": "mistral-7b",
}
_GPU_ALIASES = {
    "a100": "a100-80g",
    "a100-80gb": "a100-80g",
    "a100-sxm4-80gb": "a100-80g",
    "h100": "h100-sxm",
    "h100-80gb": "h100-sxm",
    "h100-sxm5": "h100-sxm",
    "h200-sxm": "h200",
    "h200-141gb": "h200",
    "l40s-48gb": "l40s",
}


GiB = 1 << 30


def vllm_batch_defaults(gpu: GpuSpec) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) that `vllm serve` 0.33 picks on `gpu`
    (vllm/engine/arg_utils.py EngineArgs.get_batch_defaults, OPENAI_API_SERVER usage):
    >= 160 GiB: 16384 and 1024; >= 70 GiB and not an A100: 8192 and 1024; else 2048 and 256."""
    if gpu.memory_bytes >= 160 * GiB:
        return 16384, 1024
    if gpu.memory_bytes >= 70 * GiB and not gpu.name.startswith("a100"):
        return 8192, 1024
    return 2048, 256


def get_model(name: str) -> ModelSpec:
    """The catalog model called `name` (case-insensitive; a few Hugging Face ids accepted);
    `sim.engine.hf_config.model_spec` also reads a config.json."""
    return _lookup(name, MODELS, _MODEL_ALIASES, "model")


def get_gpu(name: str) -> GpuSpec:
    """The GPU called `name` (case-insensitive; a few common spellings accepted), or the one a
    TOML file at `name` describes (`load_gpu`)."""
    if name.endswith(".toml"):
        return load_gpu(name)
    return _lookup(name, GPUS, _GPU_ALIASES, "gpu")


GPU_FIELDS = {  # a GPU file's keys: what each is, in the units the file gives
    "peak_tflops": "dense bf16 tensor-core TFLOP/s", "memory_tb_per_s": "device memory bandwidth, TB/s",
    "memory_gib": "device memory, GiB", "host_gb_per_s": "host <-> device bandwidth one way, GB/s",
}
GPU_OPTIONAL = {"gpu_gb_per_s": "GPU <-> GPU bandwidth one way, GB/s (absent: over PCIe)", "name": "its name"}


def load_gpu(path: str) -> GpuSpec:
    """A GPU from a small TOML file (`GPU_FIELDS`, and optionally `GPU_OPTIONAL`), datasheet figures:

        name = "my-gpu"
        peak_tflops = 989        # dense bf16
        memory_tb_per_s = 3.35
        memory_gib = 79.6
        host_gb_per_s = 50
        gpu_gb_per_s = 450       # omit for PCIe only
    """
    from kvsim.workloads.files import read_toml

    try:
        d = read_toml(Path(path))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    unknown = sorted(set(d) - set(GPU_FIELDS) - set(GPU_OPTIONAL))
    if unknown:
        raise ConfigError(f"{path}: unknown key {unknown[0]!r}; a GPU file has {', '.join([*GPU_FIELDS, *GPU_OPTIONAL])}")

    def number(key: str) -> float:
        v = d.get(key)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
            raise ConfigError(f"{path}: field {key!r} ({(GPU_FIELDS | GPU_OPTIONAL)[key]}): expected a positive "
                              f"number, got {v!r}")
        return float(v)

    link = number("gpu_gb_per_s") * 1e9 if "gpu_gb_per_s" in d else None
    return GpuSpec(str(d.get("name", Path(path).stem)), number("peak_tflops") * 1e12,
                   number("memory_tb_per_s") * 1e12, int(number("memory_gib") * 2**30),
                   number("host_gb_per_s") * 1e9, link)


def _lookup(name: str, table: dict, aliases: dict[str, str], what: str):
    key = name.strip().lower()
    key = aliases.get(key, key)
    if key not in table:
        raise ConfigError(f"unknown {what} {name!r}; choose from {', '.join(table)}")
    return table[key]
