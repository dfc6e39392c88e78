"""Step time and KV-cache capacity from a roofline over the model and the GPU.

One engine step runs one forward pass over the batch on each of the TP
shards. Per GPU:

    compute = (2 * params/TP * tokens + 4 * layers * heads/TP * head_dim * pairs)
              / (peak_flops * efficiency.compute)
    memory  = (weight bytes/TP + KV bytes per token * (context + tokens))
              / (hbm_bw * efficiency.memory)
    step    = max(compute, memory) + serial_fraction * min(compute, memory)
              + block ops + TP all-reduce + overhead_s

`pairs` are the (query, key) pairs attention scores. The engine passes each
prefill chunk's (prior context c, new tokens n): the chunk scores n*c +
n*(n+1)/2 pairs, and the step's decodes score their context (context less the
chunks' lengths), all exact in integers; a sliding window w caps each query's
keys at w + 1 (as the estimate caps a decode's prior at w). Given only the step's totals (the quiet runs' all-decode steps, the
roofline study), prior context is spread evenly over the sequences, c =
(context - tokens) / num_seqs, a decode token scoring c + 1 keys and a prefill
chunk of n tokens n*c + n*(n+1)/2: exact for an all-decode step and a single
chunk, but a chunk after a long prompt's first chunk, batched with decodes,
scores far more than the even spread says (6,144 new tokens after 8,192 beside
96 short decodes: 3.3x). A sliding window caps c and the context read.

Block ops cost, each: copy 2 * block bytes / HBM bw (read + write), move
4 * block bytes / HBM bw (an exchange reads and writes both blocks),
swap_out / swap_in block bytes / PCIe bw. The TP all-reduce is two per layer
of tokens * hidden * dtype bytes over NVLink (PCIe without it).

The attention-score term divides by efficiency.attention instead (attention
kernels reach a different fraction of peak than GEMMs), and serial_fraction is
the share of the shorter of compute and memory time that does not overlap the
longer (0: a pure roofline).

A replay on a GPU also prices each kernel it launches: `launch_s` per op kind (write, attention
and the block ops), the fixed GPU time of one launch however little it does (1.5-3 us on an H100
for a K/V write, more for a decode kernel of a few sequences). The simulator's own step time does
not use it: whole measured steps (under CUDA graphs) put their launches in overhead_s.

Defaults: efficiency.compute 0.5, efficiency.attention = compute,
efficiency.memory 0.8, serial_fraction 0, overhead_s 1 ms (scheduler + launch
+ sampling on the host), launch_s 2 us a kernel. A calibration profile measured on a GPU
(`SimConfig.calibration`, written by `kvsim calibrate`, which fits these
factors to measured forward steps) overrides any of them; its JSON schema,
every key optional:

    {"version": 1, "device": "h100-sxm",
     "efficiency": {"compute": 0.55, "attention": 0.4, "memory": 0.82},
     "serial_fraction": 0.3, "overhead_s": 0.0012,
     "op_cost_s": {"copy": 2e-6, "swap_out": 5e-5, "swap_in": 5e-5, "move": 4e-6},
     "launch_s": {"write": 2.5e-6, "attention": 1.4e-5, "move": 9e-6}}
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvsim.kvcache.ops import CHARGED_KINDS as OP_KINDS
from kvsim.sim.engine.catalog import GpuSpec, ModelSpec, get_gpu
from kvsim.sim.engine.config import KV_CACHE_DTYPES, ConfigError, SimConfig
from kvsim.sim.engine.hf_config import model_spec
from kvsim.sim.engine.layers import (
    HybridLayout,
    LayerKV,
    Placement,
    hybrid_layout,
    hybrid_on,
    kv_layers,
    layer_counts,
    place,
)
from kvsim.workloads.files import read_json

DEFAULT_COMPUTE_EFFICIENCY = 0.5
DEFAULT_MEMORY_EFFICIENCY = 0.8
DEFAULT_OVERHEAD_S = 1e-3
DEFAULT_LAUNCH_S = 2e-6  # GPU time of one small kernel's launch (H100: 1.5-3 us, benchmarks/results)
LAUNCH_KINDS = ("write", "attention", *OP_KINDS)  # the replay's kernel kinds a launch is priced for
CALIBRATION_VERSION = 1
# Memory vLLM's profiler finds taken besides weights and activations: CUDA graphs,
# cuBLAS workspaces, NCCL buffers, allocator slack. ~1 GiB on an 8B model.
NON_TORCH_RESERVE_BYTES = 1 << 30


@dataclass(frozen=True)
class Calibration:
    """Efficiency factors and per-op costs; None: use the roofline default."""

    compute: float = DEFAULT_COMPUTE_EFFICIENCY
    memory: float = DEFAULT_MEMORY_EFFICIENCY
    overhead_s: float = DEFAULT_OVERHEAD_S
    attention: float | None = None  # None: the compute efficiency
    serial_fraction: float = 0.0
    op_cost_s: tuple[tuple[str, float], ...] = ()
    device: str | None = None
    launch_s: tuple[tuple[str, float], ...] = ()  # per LAUNCH_KINDS kind; absent: DEFAULT_LAUNCH_S

    def launch_costs(self) -> dict[str, float]:
        """Seconds of GPU time one launch of each LAUNCH_KINDS kind costs."""
        return {**dict.fromkeys(LAUNCH_KINDS, DEFAULT_LAUNCH_S), **dict(self.launch_s)}


def load_calibration(path: str | Path) -> Calibration:
    """Read a calibration profile; a bad file or key raises ConfigError naming both."""
    p = Path(path)
    try:
        data = read_json(p)
    except ValueError as e:
        raise ConfigError(f"calibration {e}") from None
    return parse_calibration(data, p)


def parse_calibration(data: Any, p: Path) -> Calibration:
    """A calibration profile's JSON value as a Calibration; a bad key raises ConfigError naming `p`."""
    if not isinstance(data, dict):
        raise ConfigError(f"calibration {p}: expected a JSON object")
    _check_keys(p, "", data, {"version", "device", "efficiency", "serial_fraction", "overhead_s", "op_cost_s",
                              "launch_s"})
    version = data.get("version", CALIBRATION_VERSION)
    if version != CALIBRATION_VERSION:
        raise ConfigError(
            f"calibration {p}: version {version!r}, this kvsim reads {CALIBRATION_VERSION}"
        )
    device = data.get("device")
    if device is not None and not isinstance(device, str):
        raise ConfigError(f"calibration {p}: 'device' must be a string, got {device!r}")
    eff = data.get("efficiency", {})
    if not isinstance(eff, dict):
        raise ConfigError(f"calibration {p}: 'efficiency' must be an object")
    _check_keys(p, "efficiency.", eff, {"compute", "attention", "memory"})
    ops = data.get("op_cost_s", {})
    if not isinstance(ops, dict):
        raise ConfigError(f"calibration {p}: 'op_cost_s' must be an object")
    _check_keys(p, "op_cost_s.", ops, set(OP_KINDS))
    launches = data.get("launch_s", {})
    if not isinstance(launches, dict):
        raise ConfigError(f"calibration {p}: 'launch_s' must be an object")
    _check_keys(p, "launch_s.", launches, set(LAUNCH_KINDS))
    return Calibration(
        compute=_number(
            p, "efficiency.compute", eff.get("compute", DEFAULT_COMPUTE_EFFICIENCY), positive=True
        ),
        memory=_number(
            p, "efficiency.memory", eff.get("memory", DEFAULT_MEMORY_EFFICIENCY), positive=True
        ),
        overhead_s=_number(p, "overhead_s", data.get("overhead_s", DEFAULT_OVERHEAD_S)),
        attention=_number(p, "efficiency.attention", eff["attention"], positive=True) if "attention" in eff else None,
        serial_fraction=_number(p, "serial_fraction", data.get("serial_fraction", 0.0)),
        op_cost_s=tuple((k, _number(p, f"op_cost_s.{k}", v)) for k, v in ops.items()),
        device=device,
        launch_s=tuple((k, _number(p, f"launch_s.{k}", v)) for k, v in launches.items()),
    )


def _check_keys(path: Path, prefix: str, d: dict, allowed: set[str]) -> None:
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise ConfigError(
            f"calibration {path}: unknown key {prefix}{unknown[0]}; expected {', '.join(sorted(allowed))}"
        )


def _number(path: Path, key: str, value: Any, positive: bool = False) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
        or (positive and value == 0)
    ):
        need = "a positive number" if positive else "a number >= 0"
        raise ConfigError(f"calibration {path}: {key} must be {need}, got {value!r}")
    return float(value)


# GPUs whose gated-delta-net prefill is FlashInfer's in vLLM 0.33 ("auto": compute capability 9.0;
# 10.x and 12.x also need a CUDA 13 runtime and 128-wide keys, assumed here for the B200),
# vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py `_resolve_gdn_prefill_backend`
FLASHINFER_GDN = {"h100-sxm": False, "h200": False, "b200": True}  # name -> needs 128-wide keys
FLASHINFER_GDN_CHECKPOINT_ALIGNMENT = 64


def gdn_checkpoint_alignment(model: ModelSpec, gpu: GpuSpec) -> int | None:
    """The prefill checkpoint alignment of `model`'s Mamba-state layers on `gpu` in align mode: 64
    where they are gated-delta-net layers prefilled by FlashInfer (which exports a mid-prefill
    state), else None (Triton's kernels, Mamba1 and Mamba2 layers: none)."""
    wide = FLASHINFER_GDN.get(gpu.name)
    if model.linear_kind != "gated_delta_net" or wide is None or (wide and model.linear_key_head_dim != 128):
        return None
    return FLASHINFER_GDN_CHECKPOINT_ALIGNMENT


class CostModel:
    """Seconds per engine step and KV blocks per GPU for one model on one GPU type."""

    def __init__(
        self,
        model: ModelSpec,
        gpu: GpuSpec,
        tensor_parallel: int = 1,
        block_size: int = 16,
        calibration: Calibration | None = None,
        sliding_window: int | None = None,
        kv_dtype_bytes: int | None = None,
        *,
        disable_hybrid: bool | None = True,
        hybrid_chunked_local: bool = False,
        prefix_caching: bool = True,
    ):
        tp = tensor_parallel
        if tp < 1 or model.num_heads % tp:
            raise ConfigError(
                f"tensor_parallel {tp} must divide {model.name}'s {model.num_heads} attention heads"
            )
        cal = calibration or Calibration()
        self.model, self.gpu, self.tensor_parallel, self.block_size = model, gpu, tp, block_size
        self.calibration = cal
        dt = model.dtype_bytes
        self.kv_dtype_bytes = kv_dtype_bytes or dt  # --kv-cache-dtype; None: the model's ("auto")
        self.layers = kv_layers(model, tp, block_size, self.kv_dtype_bytes)
        try:
            self.placement: Placement | None = place(model, self.layers)
            self.placement_error: ConfigError | None = None
        except ConfigError as e:  # a model with Mamba-state layers among attention ones: priced, not sized
            self.placement, self.placement_error = None, e
        if sliding_window is not None and len(layer_counts(self.layers)) > 1:
            raise ConfigError(f"sliding_window {sliding_window}: {model.name} has layers of more than one kind "
                              "(their windows come from its config)")
        self.sliding_window = sliding_window if sliding_window is not None else self.placement and self.placement.window
        attention = [layer for layer in self.layers if layer.kind not in ("mamba", "none")]
        self.kv_bytes_per_block = sum(layer.page_bytes for layer in attention)  # one block, every layer
        # vLLM's hybrid KV-cache groups (`disable_hybrid`: its --disable-hybrid-kv-cache-manager,
        # None as vLLM on CUDA decides), for a model mixing layer kinds: a block holds a page of
        # every layer of one group
        self.layout: HybridLayout | None = None
        mamba = any(layer.kind == "mamba" for layer in self.layers)
        if mamba and not disable_hybrid and len(layer_counts(self.layers)) > 1:
            # vLLM has no fallback for Mamba state beside attention: its groups, the block size
            # raised to hold a state (vLLM: "align" mode, FlashInfer checkpoints on Hopper)
            self.layout = hybrid_layout(self.layers, model.name, block_size,
                                        gdn_checkpoint_alignment(model, gpu) if prefix_caching else None)
            self.kv_bytes_per_block = self.layout.bytes_per_block
            self.block_size = self.layout.block_size  # (`layers` keep their pages of `block_size` tokens)
            self.placement, self.placement_error = Placement(None, None), None
        elif self.placement is not None and self.placement.approximation is not None \
                and hybrid_on(model, self.layers, disable_hybrid, hybrid_chunked_local):
            self.layout = hybrid_layout(self.layers, model.name)
            self.kv_bytes_per_block = self.layout.bytes_per_block
            self.placement = Placement(None, None)
        self.kv_bytes_per_token = self.kv_bytes_per_block // self.block_size
        wb = model.weight_dtype_bytes or dt  # a quantized checkpoint's weights (fp8: 1 byte)
        ewb = model.expert_weight_bytes or wb  # experts quantized alone (gpt-oss's MXFP4)
        experts = model.moe_layers * model.num_experts * model.expert_params()  # routed, every layer
        self.weight_bytes = ((model.num_params - experts) * wb + experts * ewb) / tp
        # per-step constants, in seconds per unit
        compute_rate = gpu.peak_flops * cal.compute
        mem_rate = gpu.hbm_bw * cal.memory
        self._s_per_token_flops = 2 * model.active_params() / tp / compute_rate  # (a MoE: active only)
        attention_rate = gpu.peak_flops * (cal.attention or cal.compute)
        # a (query token, cached token) pair per head: q.k and the weighted v, 2 FLOPs a dimension
        # each; MLA with its projections absorbed scores and sums over the latent (and rotary key)
        per_head = (2 * (model.kv_lora_rank + model.qk_rope_head_dim) + 2 * model.kv_lora_rank if model.mla
                    else 4 * model.head_dim)
        s_per_pair_layer = (model.num_heads // tp) * per_head / attention_rate
        # attention by window: (tokens read at most, or None for all; s per pair; s per cached token)
        windows: dict[int | None, list[LayerKV]] = {}
        for layer in attention:
            w = sliding_window if sliding_window is not None else layer.window
            windows.setdefault(w, []).append(layer)
        self._attention = tuple(
            (w, len(group) * s_per_pair_layer, sum(x.page_bytes for x in group) / block_size / mem_rate)
            for w, group in windows.items())
        # state-space layers (gated delta net, Mamba) read and write each sequence's state once a
        # step; their recurrence costs 4 FLOPs an element of the state a token (ModelSpec.state_flops_per_token)
        linear = [layer for layer in self.layers if layer.kind == "mamba"]
        self._s_state_per_seq = 2 * sum(x.page_bytes for x in linear) / mem_rate
        if linear:
            self._s_per_token_flops += len(linear) * model.state_flops_per_token(tp) / compute_rate
        self._serial = cal.serial_fraction
        self._s_weights = self.weight_bytes / mem_rate
        # A mixture of experts reads only the experts its batch's tokens pick. Assumed: each token
        # picks k of the E experts uniformly and independently per layer (no expert parallelism:
        # every rank holds 1/tp of each expert), so T tokens touch E (1 - (1 - k/E)^T) of them
        self._moe = model.num_experts > 0
        if self._moe:
            self._s_weights = (self.weight_bytes - experts * ewb / tp) / mem_rate  # attention, dense MLPs, embeddings
            self._s_per_expert = model.moe_layers * model.expert_params() * ewb / tp / mem_rate
            self._expert_miss = 1.0 - model.experts_per_token / model.num_experts
        link = gpu.nvlink_bw or gpu.pcie_bw
        self.allreduce_s_per_token = (
            2 * model.num_layers * model.hidden_size * dt / link if tp > 1 else 0.0
        )
        self.overhead_s = cal.overhead_s
        bb = self.kv_bytes_per_block
        op_cost = {
            "copy": 2 * bb / gpu.hbm_bw,
            "swap_out": bb / gpu.pcie_bw,
            "swap_in": bb / gpu.pcie_bw,
            "store": bb / gpu.pcie_bw,  # offloading (sim.engine.offload): timed on the host link, not
            "load": bb / gpu.pcie_bw,  # charged to a step (each TP rank moves its share in parallel)
            "move": 4 * bb / gpu.hbm_bw,
        }
        op_cost.update(cal.op_cost_s)
        self.op_cost_s: dict[str, float] = op_cost
        self._op_items = tuple((k, op_cost[k]) for k in OP_KINDS)  # the kinds a step is charged for

    @classmethod
    def from_config(cls, cfg: SimConfig, calibration: Calibration | None = None) -> CostModel:
        """The cost model `cfg` names: model, GPU, TP, block size, calibration (or `calibration`
        in its place), window."""
        cal = calibration or (load_calibration(cfg.calibration) if cfg.calibration else None)
        return cls(
            model_spec(cfg.model),
            get_gpu(cfg.gpu),
            cfg.tensor_parallel,
            cfg.block_size,
            cal,
            cfg.sliding_window,
            KV_CACHE_DTYPES[cfg.kv_cache_dtype],
            disable_hybrid=cfg.disable_hybrid_kv_cache_manager,
            hybrid_chunked_local=cfg.hybrid_chunked_local,
            prefix_caching=cfg.enable_prefix_caching,
        )

    def experts_touched(self, tokens: int) -> float:
        """Expected distinct experts per MoE layer that `tokens` tokens pick (see __init__)."""
        m = self.model
        return m.num_experts * (1.0 - self._expert_miss**tokens)

    def activation_reserve_bytes(self, cfg: SimConfig) -> int:
        """Peak non-KV memory vLLM's profiling run would find, per GPU (our estimate).

        A forward of max_num_batched_tokens tokens peaks in the MLP: gate/up
        output (2 * intermediate) and activation (intermediate) per token, plus
        four hidden-size buffers (residual, normed, attention in/out); fp32
        logits for max_num_seqs sampled rows; and NON_TORCH_RESERVE_BYTES.
        """
        m, tp = self.model, self.tensor_parallel
        per_token = (3 * m.intermediate_size // tp + 4 * m.hidden_size) * m.dtype_bytes
        max_tokens, max_seqs = cfg.batch_limits()
        logits = max_seqs * m.vocab_size * 4
        return max_tokens * per_token + logits + NON_TORCH_RESERVE_BYTES

    def kv_memory_bytes(self, cfg: SimConfig) -> float:
        """Memory left for the KV cache on one GPU, as vLLM's profiling would find it (our estimate):
        memory x utilization - weights - the activation reserve."""
        budget = self.gpu.memory_bytes * cfg.gpu_memory_utilization
        return budget - self.weight_bytes - self.activation_reserve_bytes(cfg)

    def num_gpu_blocks(self, cfg: SimConfig) -> int:
        """cfg.num_gpu_blocks, or what vLLM would allocate: (memory * utilization
        - weights - activation reserve) // bytes per block, all per GPU."""
        if self.placement_error is not None:
            raise self.placement_error
        if cfg.num_gpu_blocks is not None:
            return cfg.num_gpu_blocks
        budget = self.gpu.memory_bytes * cfg.gpu_memory_utilization
        blocks = int(self.kv_memory_bytes(cfg) // self.kv_bytes_per_block)
        if blocks < 2:
            gb = 1e9
            raise ConfigError(
                f"{self.model.name} does not fit on {self.gpu.name} with tensor_parallel="
                f"{self.tensor_parallel}, gpu_memory_utilization={cfg.gpu_memory_utilization}: "
                f"{budget / gb:.1f} GB usable, {self.weight_bytes / gb:.1f} GB weights and "
                f"{self.activation_reserve_bytes(cfg) / gb:.1f} GB activations per GPU"
            )
        return blocks

    def bounds(self, prefill_tokens: int, decode_tokens: int, context_tokens: int, num_seqs: int,
               chunks: Sequence[tuple[int, int]] = ()) -> tuple[float, float]:
        """(compute, memory) seconds of one forward over a batch (step_time's arguments) at this
        cost model's rates: FLOPs over peak x efficiency, bytes over bandwidth x efficiency. With
        every efficiency 1 these are the roofline's bounds (`sim.studies.roofline`). With `chunks`,
        each window's attention pairs are exact (`_exact_pairs`); without, estimated from the totals."""
        tokens = prefill_tokens + decode_tokens
        seqs = num_seqs if num_seqs > 0 else 1
        if chunks:
            decode_ctx = context_tokens - sum(c + n for c, n in chunks)
        else:
            prior = (context_tokens - tokens) / seqs
            if prior < 0.0:
                prior = 0.0
            new_pairs = decode_tokens
            if prefill_tokens:
                n_chunks = num_seqs - decode_tokens if num_seqs > decode_tokens else 1
                new_pairs += prefill_tokens * (prefill_tokens / n_chunks + 1) / 2
        compute = tokens * self._s_per_token_flops
        memory = self._s_weights + seqs * self._s_state_per_seq
        for w, s_pair, s_kv in self._attention:  # each window reads at most its window
            ctx = context_tokens
            if w is not None and ctx > seqs * w:
                ctx = seqs * w
            if chunks:
                compute += _exact_pairs(w, decode_tokens, decode_ctx, chunks) * s_pair
            else:
                p = prior if w is None or prior <= w else w
                compute += (tokens * p + new_pairs) * s_pair
            memory += (ctx + tokens) * s_kv
        if self._moe:
            memory += self.experts_touched(tokens) * self._s_per_expert
        return compute, memory

    def step_time(
        self,
        prefill_tokens: int,
        decode_tokens: int,
        context_tokens: int,
        num_seqs: int,
        op_counts: Mapping[str, int] | None = None,
        chunks: Sequence[tuple[int, int]] = (),
    ) -> float:
        """Seconds for one engine step.

        prefill_tokens / decode_tokens: tokens computed this step (prompt chunks /
        one per decoding sequence); context_tokens: sum over the scheduled
        sequences of their length after the step (cached before + computed now);
        num_seqs: sequences scheduled; op_counts: block ops by kind (others ignored);
        chunks: each prefill chunk's (prior context, new tokens), which makes the
        attention pairs exact (empty: estimated from the totals).
        """
        t = self.overhead_s
        tokens = prefill_tokens + decode_tokens
        if tokens > 0:
            compute, memory = self.bounds(prefill_tokens, decode_tokens, context_tokens, num_seqs, chunks)
            if compute > memory:
                t += compute + self._serial * memory
            else:
                t += memory + self._serial * compute
            t += tokens * self.allreduce_s_per_token
        if op_counts:
            for kind, cost in self._op_items:
                n = op_counts.get(kind)
                if n:
                    t += n * cost
        return t


def smallest_tp(model: str, gpu: str, utilization: float = 0.9) -> int | None:
    """The fewest GPUs (1, 2, 4, 8) whose memory holds the model's weights and activations with
    room left for a cache; None: eight do not."""
    for tp in (1, 2, 4, 8):
        cfg = SimConfig(model=model, gpu=gpu, tensor_parallel=tp, gpu_memory_utilization=utilization)
        try:
            cost = CostModel.from_config(cfg.validate())
        except ConfigError:  # heads not divisible by tp
            continue
        free = cost.gpu.memory_bytes * utilization - cost.weight_bytes - cost.activation_reserve_bytes(cfg)
        if free >= 2 * cost.kv_bytes_per_block:
            return tp
    return None


def _exact_pairs(window: int | None, decodes: int, decode_ctx: int, chunks: Sequence[tuple[int, int]]) -> int:
    """The (query, key) pairs one attention layer kind scores in a step whose prefill chunks are
    known, in integers (so the chunks' order cannot change a step's time): each chunk of n new
    tokens after c scores n * c + n * (n + 1) / 2, the decodes their context `decode_ctx`; a
    window w caps each query's keys at w + 1 (as the estimate caps a decode's prior at w), the
    decodes' all at once (their priors spread evenly)."""
    if window is None:
        return decode_ctx + sum(n * c + n * (n + 1) // 2 for c, n in chunks)
    cap = window + 1
    pairs = decode_ctx if decode_ctx <= decodes * cap else decodes * cap
    for c, n in chunks:
        k = min(n, max(0, cap - c))  # queries whose keys all fit the window
        pairs += k * c + k * (k + 1) // 2 + (n - k) * cap
    return pairs
