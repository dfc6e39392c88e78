"""One synthetic forward step of a served model, timed and described in `CostModel.step_time`'s terms.

`ForwardStep` builds random weights (no checkpoint) for ONE decoder layer as a
tensor-parallel rank holds it (heads/tp, kv_heads/tp but at least 1,
intermediate/tp, full hidden) and runs it num_layers times, then the LM head on
one row per sequence (the sampled rows). Reusing one layer's weights does not
flatter the timing: a layer is hundreds of MB (~440 MB for Llama-3-8B), far
above the GPU's ~50 MB L2, so every layer streams its weights from HBM again
(a mixture-of-experts layer reads its attention and the experts its tokens
touch: ~110 MB for Qwen3-30B-A3B at one token).

Per layer: RMSNorm, fused QKV GEMM (RMSNorm of q and k per head where the model
has it, as Qwen3), rotary embedding (rotate-half, plain torch ops), K/V written
to a paged cache (`gpu.kernels.write_kv`), attention (the paged Triton decode
kernel for all decode tokens in one call; torch SDPA per prefill chunk over the
dense K/V of its prior context + new tokens, gathered from the cache, with a
bottom-right-aligned causal mask), output GEMM, residual add, RMSNorm, the MLP,
residual add. The MLP is dense (gate_up GEMM, SiLU*mul, down GEMM) except on
the first `moe_layers` layers of a mixture of experts, which run `moe_mlp`: the
router GEMM and its top-k, then each touched expert's gated MLP over its tokens
as two batched GEMMs, weighted and summed back per token, plus any shared expert
as a dense MLP. As the cost model assumes (`CostModel.experts_touched`), each
token picks k of the E experts uniformly (`route`), and only the touched experts'
weights are read.

Excluded: the TP all-reduces (two per layer; the cost model charges them
separately), sampling and everything on the host (scheduling, input prep:
`CostModel.overhead_s`), and sliding windows and chunked attention (attention is
always full). The embedding lookup reads the LM head's matrix (tied), a few rows
per token. Unlike vLLM, the kernels are not fused (norm + residual, SiLU*mul,
rotary) and prefill attention gathers its K/V densely and expands KV heads for
SDPA; both cost little next to the GEMMs, except a short chunk after a long
prior (256 new tokens after 8,192: the gather's bytes show). The MoE routing is
fixed per batch (drawn in `prepare`, the same for every layer), not taken from
the router's logits, so that the step has static shapes for a CUDA graph. The
experts run as one grouped GEMM over the rows sorted by expert
(`torch._grouped_mm`, `moe_kernel="grouped"`, the CLI's default in bfloat16:
unpadded, as vLLM's fused MoE kernel runs them) or as batched GEMMs with every
touched expert computing as many rows as the busiest one has tokens
(`moe_kernel="bmm"`, padding rows weigh 0; the first H100 session's rows, which
ran far below GEMM efficiency at prefill); the experts' and router's biases
(gpt-oss, DeepSeek-V3) are not built. What it cannot build at all (MLA,
linear-attention layers, quantized weights, ...) `check_buildable` refuses.

One KV cache, sized for the batch, is shared by all layers: a per-layer cache
would only multiply memory, since for the batches where KV reads matter the
cache is far above L2 anyway (for tiny batches it fits L2, but then its reads
are negligible next to the weights). Block tables hold random distinct block ids.

`measure` captures the whole step as a CUDA graph on CUDA (vLLM runs decode
under CUDA graphs), falling back to eager if capture raises, and times it
with CUDA events. `run_grid` measures `default_grid` (or `holdout_grid`, points
the calibration was not fitted to); `python -m gpu.forward_step --model
llama-3-8b --tp 1 --out rows.json` writes the rows.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvsim.gpu.kernels import decode_attention, write_kv
from kvsim.gpu.timing import capture_graph, time_call
from kvsim.sim.engine.catalog import ModelSpec, get_gpu
from kvsim.sim.engine.cost_model import CostModel
from kvsim.sim.engine.hf_config import model_spec

ROPE_THETA = 500_000.0  # Llama-3's
RMS_EPS = 1e-5
GiB = 1 << 30
KV_LIMIT_BYTES = 60 * 10**9  # the shared one-layer cache of a grid point stays under this

# A model small enough for Triton's interpreter on CPU (tests, --quick).
_TINY = ModelSpec(
    name="tiny", num_params=0, num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
    head_dim=16, intermediate_size=96, vocab_size=128, max_model_len=256,
)  # fmt: skip
TINY = replace(_TINY, num_params=_TINY.count_params())
# ... and a mixture of experts: layer 0 holds 8 experts (2 a token) and a shared expert, layer 1 a
# dense MLP; q/k norms as Qwen3 has them
_TINY_MOE = replace(TINY, name="tiny-moe", num_experts=8, experts_per_token=2, moe_intermediate_size=32,
                    moe_layers=1, shared_expert_intermediate_size=24, qk_norm=True)
TINY_MOE = replace(_TINY_MOE, num_params=_TINY_MOE.count_params())


def resolve_model(model: str | ModelSpec) -> ModelSpec:
    """`model` itself, or the catalog model or config file it names (`hf_config.model_spec`:
    the dense catalog models and those kept as config.json, e.g. qwen3-30b-a3b)."""
    return model if isinstance(model, ModelSpec) else model_spec(model)


def check_buildable(model: ModelSpec) -> None:
    """ValueError naming the model and each feature of it ForwardStep does not build (its step
    would be another model's), rather than timing something else under its name."""
    missing = [what for has, what in (
        (model.mla, f"multi-head latent attention (kv_lora_rank {model.kv_lora_rank})"),
        ("linear_attention" in model.layer_types or model.separate_ffn_layers,
         "linear-attention / state-space layers (layer_types)"),
        (model.attention_sinks, "attention sinks (attention_sinks)"),
        (model.attn_output_gate, "a gated attention output (attn_output_gate)"),
        (model.shared_expert_gate, "a gated shared expert (shared_expert_gate)"),
        (not model.gated_mlp, "an ungated MLP (gated_mlp false)"),
        (model.norms_per_layer != 2, f"{model.norms_per_layer} norms a layer (norms_per_layer)"),
        (model.weight_dtype_bytes not in (None, model.dtype_bytes)
         or model.expert_weight_bytes not in (None, model.dtype_bytes),
         "quantized weights (weight_dtype_bytes / expert_weight_bytes)"),
    ) if has]  # fmt: skip
    if missing:
        raise ValueError(f"gpu.forward_step cannot build {model.name}: it has {'; '.join(missing)}")


@dataclass(frozen=True)
class Batch:
    """A step's composition: decoding sequences (context length after the step; each
    computes one token) and prefill chunks ((prior cached context, new tokens) each)."""

    decode_ctx: tuple[int, ...] = ()
    prefill: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if any(c < 1 for c in self.decode_ctx):
            raise ValueError(f"decode_ctx {self.decode_ctx}: each context must be >= 1")
        if any(p < 0 or n < 1 for p, n in self.prefill):
            raise ValueError(f"prefill {self.prefill}: need prior >= 0 and new tokens >= 1")

    @property
    def prefill_tokens(self) -> int:
        return sum(n for _, n in self.prefill)

    @property
    def decode_tokens(self) -> int:
        return len(self.decode_ctx)

    @property
    def context_tokens(self) -> int:
        """Sum over the scheduled sequences of their length after the step."""
        return sum(self.decode_ctx) + sum(p + n for p, n in self.prefill)

    @property
    def num_seqs(self) -> int:
        return len(self.decode_ctx) + len(self.prefill)

    def seqs(self) -> list[tuple[int, int]]:
        """(prior, new) for every sequence, decodes first (as vLLM orders them)."""
        return [(c - 1, 1) for c in self.decode_ctx] + list(self.prefill)

    def describe(self) -> str:
        """E.g. 'dec 32@2048 + pre 2048@0': 32 decodes at context 2048, a 2048-token chunk after
        0 cached tokens; 'dec 64@128..8192': decodes at more than three distinct contexts."""
        counts = Counter(self.decode_ctx)
        if len(counts) > 3:
            parts = [f"dec {len(self.decode_ctx)}@{min(counts)}..{max(counts)}"]
        else:
            parts = [f"dec {k}@{c}" for c, k in counts.items()]
        parts += [f"pre {n}@{p}" if k == 1 else f"pre {k}x{n}@{p}" for (p, n), k in Counter(self.prefill).items()]
        return " + ".join(parts) or "empty"


def decodes(count: int, ctx: int) -> tuple[int, ...]:
    """`count` decoding sequences at context `ctx`."""
    return (ctx,) * count


MOE_KERNELS = ("bmm", "grouped")


def default_moe_kernel(dtype: torch.dtype) -> str:
    """`grouped` where torch has a bfloat16 grouped GEMM (`torch._grouped_mm`, 2.8 on), else `bmm`."""
    return "grouped" if dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm") else "bmm"


@dataclass
class Routing:
    """A batch's fixed expert choice, laid out for `ForwardStep.moe_mlp`: the touched experts are
    relabelled 0..experts-1, each given `capacity` rows (the busiest expert's token count)."""

    experts: int  # distinct experts the batch's tokens touch
    capacity: int
    slots: torch.Tensor  # [experts * capacity] int64: the token each row reads and adds to (padding: 0)
    slot_weights: torch.Tensor  # [experts * capacity, 1]: the row's routing weight (padding: 0)
    token_experts: torch.Tensor  # [tokens, k] int64 on the CPU: each token's experts, relabelled
    token_weights: torch.Tensor  # [tokens, k] float32 on the CPU: their weights (summing to 1)
    # the same picks unpadded, sorted by expert, for a grouped GEMM (`torch._grouped_mm`)
    sorted_slots: torch.Tensor  # [tokens * k] int64: the token each row reads and adds to
    sorted_weights: torch.Tensor  # [tokens * k, 1]: the row's routing weight
    offsets: torch.Tensor  # [experts] int32: where each expert's rows end


def route(tokens: int, num_experts: int, k: int, generator: torch.Generator) -> Routing:
    """Each token picks k distinct experts of num_experts uniformly (the top k of uniform
    draws) with softmax-normalised random weights, as `CostModel.experts_touched` assumes.
    The weights of all experts being i.i.d., the touched ones are relabelled 0..m-1, so the
    step reads expert weights through a view [:m]. Tensors on the CPU."""
    picks = torch.rand((tokens, num_experts), generator=generator).topk(k, dim=1).indices
    weights = torch.randn((tokens, k), generator=generator).softmax(-1)
    touched, labels = torch.unique(picks, return_inverse=True)
    flat = labels.flatten()
    counts = torch.bincount(flat, minlength=len(touched))
    capacity = int(counts.max())
    order = torch.argsort(flat, stable=True)
    rank = torch.empty_like(flat)  # each (token, pick)'s place among its expert's tokens
    rank[order] = torch.arange(len(flat)) - (torch.cumsum(counts, 0) - counts)[flat[order]]
    row = flat * capacity + rank
    slots = torch.zeros(len(touched) * capacity, dtype=torch.int64)
    slots[row] = torch.arange(tokens).repeat_interleave(k)
    slot_weights = torch.zeros(len(touched) * capacity, 1)
    slot_weights[row, 0] = weights.flatten()
    token_of = torch.arange(tokens).repeat_interleave(k)
    return Routing(len(touched), capacity, slots, slot_weights, labels, weights,
                   token_of[order], weights.flatten()[order, None], torch.cumsum(counts, 0).to(torch.int32))


@dataclass
class StepInputs:
    """Device tensors one batch's step reads: the shared paged cache, tables, slots, token data."""

    batch: Batch
    key_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor
    seq_blocks: list[torch.Tensor]  # block ids of each sequence, Batch.seqs() order
    decode_tables: torch.Tensor  # [decodes, max_blocks] int32
    decode_lens: torch.Tensor  # [decodes] int32
    slot_mapping: torch.Tensor  # [tokens] int64
    cos: torch.Tensor  # [tokens, 1, head_dim / 2]
    sin: torch.Tensor
    token_ids: torch.Tensor  # [tokens]
    sample_rows: torch.Tensor  # [num_seqs]: each sequence's last token
    routing: Routing | None = None  # a mixture of experts: slots, slot_weights on the device


class ForwardStep:
    """A model's decoder layer as one TP rank sees it, run num_layers times, plus the LM head.
    A mixture of experts holds one MoE layer's weights too (each expert's intermediate / tp)."""

    def __init__(self, model: ModelSpec, tp: int = 1, device: str | torch.device | None = None,
                 dtype: torch.dtype = torch.bfloat16, block_size: int = 16, seed: int = 0,
                 moe_kernel: str = "bmm"):
        check_buildable(model)
        if moe_kernel not in MOE_KERNELS:
            raise ValueError(f"moe_kernel {moe_kernel!r}: choose from {', '.join(MOE_KERNELS)}")
        if moe_kernel == "grouped" and (dtype != torch.bfloat16 or not hasattr(torch, "_grouped_mm")):
            raise ValueError(f"moe_kernel 'grouped' needs bfloat16 and torch._grouped_mm (torch {torch.__version__}, "
                             f"{str(dtype).removeprefix('torch.')})")
        self.moe_kernel = moe_kernel
        if tp < 1 or model.num_heads % tp:
            raise ValueError(f"tp {tp} must divide {model.name}'s {model.num_heads} attention heads")
        self.model, self.tp, self.dtype, self.block_size = model, tp, dtype, block_size
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.heads, self.kv_heads = model.num_heads // tp, max(1, model.num_kv_heads // tp)
        self.head_dim, hidden = model.head_dim, model.hidden_size
        inter, vocab = math.ceil(model.intermediate_size / tp), math.ceil(model.vocab_size / tp)
        self._gen = torch.Generator(device=self.device).manual_seed(seed)
        qkv = (self.heads + 2 * self.kv_heads) * self.head_dim
        self.w_qkv = self._weight(qkv, hidden)
        self.b_qkv = self._randn(qkv) * 0.1 if model.qkv_bias else None
        self.w_o = self._weight(hidden, self.heads * self.head_dim)
        dense = model.num_layers > model.moe_layers
        self.w_gate_up = self._weight(2 * inter, hidden) if dense else None
        self.w_down = self._weight(hidden, inter) if dense else None
        self.norm_attn, self.norm_mlp, self.norm_final = (1 + 0.1 * self._randn(hidden) for _ in range(3))
        self.lm_head = self._weight(vocab, hidden)  # also the embedding table
        half = self.head_dim // 2
        self.inv_freq = ROPE_THETA ** (-torch.arange(half, dtype=torch.float64) / half)
        # drawn after the dense model's weights, which stay as they were
        self.b_o = self._randn(hidden) * 0.1 if model.o_bias else None
        # q/k norms per head: one weight row per query head then per KV head
        self.qk_norm = torch.cat((1 + 0.1 * self._randn(1, self.head_dim).expand(self.heads, -1),
                                  1 + 0.1 * self._randn(1, self.head_dim).expand(self.kv_heads, -1))) \
            if model.qk_norm else None
        if model.num_experts:
            moe_inter = math.ceil(model.moe_intermediate_size / tp)
            experts = model.num_experts
            self.w_router = self._weight(experts, hidden)
            # [E, in, out], as torch.bmm takes them without a transposed copy
            self.w_experts_gate_up = self._randn(experts, hidden, 2 * moe_inter) / math.sqrt(hidden)
            self.w_experts_down = self._randn(experts, moe_inter, hidden) / math.sqrt(moe_inter)
            shared = math.ceil((model.shared_expert_intermediate_size
                                or model.shared_experts * model.moe_intermediate_size) / tp)
            self.w_shared_gate_up = self._weight(2 * shared, hidden) if shared else None
            self.w_shared_down = self._weight(hidden, shared) if shared else None

    def _randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=self._gen, device=self.device, dtype=self.dtype)

    def _weight(self, rows: int, cols: int) -> torch.Tensor:
        return self._randn(rows, cols) / math.sqrt(cols)

    def prepare(self, batch: Batch, seed: int = 0) -> StepInputs:
        """A random-filled paged cache holding exactly the batch's sequences, and the step's inputs."""
        if not batch.num_seqs:
            raise ValueError("an empty batch has no forward step")
        bs, seqs, cpu = self.block_size, batch.seqs(), torch.Generator().manual_seed(seed)
        counts = [math.ceil((p + n) / bs) for p, n in seqs]
        perm = torch.randperm(sum(counts), generator=cpu)
        blocks = list(torch.split(perm, counts))
        slots, positions = [], []
        for (p, n), b in zip(seqs, blocks, strict=True):
            pos = torch.arange(p, p + n)
            slots.append(b[pos // bs] * bs + pos % bs)
            positions.append(pos)
        nd = batch.decode_tokens
        tables = torch.zeros((nd, max(counts[:nd], default=1)), dtype=torch.int32)
        for i in range(nd):
            tables[i, : counts[i]] = blocks[i]
        angles = torch.cat(positions).double()[:, None] * self.inv_freq
        shape = (sum(counts), bs, self.kv_heads, self.head_dim)
        dev = self.device
        return StepInputs(
            batch=batch,
            key_cache=self._randn(*shape), value_cache=self._randn(*shape),
            seq_blocks=[b.to(dev) for b in blocks],
            decode_tables=tables.to(dev),
            decode_lens=torch.tensor(batch.decode_ctx, dtype=torch.int32).to(dev),
            slot_mapping=torch.cat(slots).to(dev),
            cos=angles.cos()[:, None].to(self.dtype).to(dev), sin=angles.sin()[:, None].to(self.dtype).to(dev),
            token_ids=torch.randint(self.lm_head.shape[0], (len(angles),), generator=cpu).to(dev),
            sample_rows=torch.cumsum(torch.tensor([n for _, n in seqs]), 0).sub(1).to(dev),
            routing=self._route(len(angles), cpu),
        )

    def _route(self, tokens: int, generator: torch.Generator) -> Routing | None:
        """A mixture of experts' fixed routing (`route`), drawn after everything else of the
        step, its row tensors on the device; None for a dense model."""
        if not self.model.num_experts:
            return None
        r = route(tokens, self.model.num_experts, self.model.experts_per_token, generator)
        dev = self.device
        return replace(r, slots=r.slots.to(dev), slot_weights=r.slot_weights.to(self.dtype).to(dev),
                       sorted_slots=r.sorted_slots.to(dev), sorted_weights=r.sorted_weights.to(self.dtype).to(dev),
                       offsets=r.offsets.to(dev))

    def forward(self, s: StepInputs) -> torch.Tensor:
        """The step: embedding, num_layers layers, final norm and LM head. Returns the sampled
        rows' logits [num_seqs, vocab / tp]."""
        x = F.embedding(s.token_ids, self.lm_head)
        for i in range(self.model.num_layers):
            x = self.layer(x, s, moe=i < self.model.moe_layers)
        h = F.rms_norm(x.index_select(0, s.sample_rows), (x.shape[1],), self.norm_final, RMS_EPS)
        return F.linear(h, self.lm_head)

    def layer(self, x: torch.Tensor, s: StepInputs, moe: bool = False) -> torch.Tensor:
        """One decoder layer over all the step's tokens x [tokens, hidden]; its MLP a mixture
        of experts if `moe`."""
        t, hidden = x.shape
        heads, kvh, d = self.heads, self.kv_heads, self.head_dim
        qkv = F.linear(F.rms_norm(x, (hidden,), self.norm_attn, RMS_EPS), self.w_qkv, self.b_qkv)
        qk = qkv[:, : (heads + kvh) * d].view(t, heads + kvh, d)
        if self.qk_norm is not None:
            qk = F.rms_norm(qk, (d,), eps=RMS_EPS) * self.qk_norm
        qk = rope(qk, s.cos, s.sin)
        q, k = qk[:, :heads], qk[:, heads:]
        v = qkv[:, (heads + kvh) * d:].view(t, kvh, d)
        write_kv(k, v, s.key_cache, s.value_cache, s.slot_mapping)
        x = x + F.linear(self.attention(q, s), self.w_o, self.b_o)
        h = F.rms_norm(x, (hidden,), self.norm_mlp, RMS_EPS)
        return x + (self.moe_mlp(h, s.routing) if moe else gated_mlp(h, self.w_gate_up, self.w_down))

    def moe_mlp(self, h: torch.Tensor, r: Routing) -> torch.Tensor:
        """The experts over h [tokens, hidden] as `r` routes it: gather each touched expert's rows,
        two GEMMs over experts [:m], weight the rows and add them back per token; plus the shared
        expert. `moe_kernel` "bmm": batched GEMMs over rows padded to the busiest expert's count;
        "grouped": `torch._grouped_mm` over the rows sorted by expert, unpadded (as a fused MoE
        kernel runs them). Static shapes (a CUDA graph captures it); the router runs but is not obeyed."""
        logits = F.linear(h, self.w_router)
        logits.topk(self.model.experts_per_token, dim=-1)  # vLLM's top-k of the router; fixed routing instead
        w_gate_up, w_down = self.w_experts_gate_up[: r.experts], self.w_experts_down[: r.experts]
        if self.moe_kernel == "grouped":  # rows sorted by expert, no padding: one grouped GEMM each
            slots = r.sorted_slots
            gate, up = torch._grouped_mm(h.index_select(0, slots), w_gate_up, offs=r.offsets).chunk(2, -1)
            out_rows = torch._grouped_mm(F.silu(gate) * up, w_down, offs=r.offsets) * r.sorted_weights
        else:
            slots = r.slots
            rows = h.index_select(0, slots).view(r.experts, r.capacity, -1)
            gate, up = torch.bmm(rows, w_gate_up).chunk(2, -1)
            out_rows = torch.bmm(F.silu(gate) * up, w_down).flatten(0, 1) * r.slot_weights
        out = torch.zeros_like(h).index_add_(0, slots, out_rows)
        if self.w_shared_gate_up is not None:
            out = out + gated_mlp(h, self.w_shared_gate_up, self.w_shared_down)
        return out

    def attention(self, q: torch.Tensor, s: StepInputs) -> torch.Tensor:
        """q [tokens, heads, D] over the cache (already holding this step's K/V): [tokens, heads * D]."""
        # NOTE: imported here: torch.nn.attention.bias imports triton, which must come after gpu.kernels
        from torch.nn.attention.bias import causal_lower_right

        batch, nd = s.batch, s.batch.decode_tokens
        outs = []
        if nd:
            out = decode_attention(q[:nd], s.key_cache, s.value_cache, s.decode_tables, s.decode_lens,
                                   max_context=max(batch.decode_ctx))
            outs.append(out.flatten(1))
        start = nd
        for (p, n), blocks in zip(batch.prefill, s.seq_blocks[nd:], strict=True):
            k, v = (self._dense(c, blocks, p + n) for c in (s.key_cache, s.value_cache))
            qi = q[start: start + n].transpose(0, 1)[None]
            if p:  # NOTE: query i sits at position p + i: the mask's diagonal is bottom-right aligned
                o = F.scaled_dot_product_attention(qi, k, v, attn_mask=causal_lower_right(n, p + n))
            else:
                o = F.scaled_dot_product_attention(qi, k, v, is_causal=True)
            outs.append(o[0].transpose(0, 1).reshape(n, -1))
            start += n
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _dense(self, cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
        """A sequence's first `length` cached K or V, KV heads expanded to query heads: [1, heads, length, D]."""
        kv = cache.index_select(0, blocks).flatten(0, 1)[:length]
        group = self.heads // self.kv_heads
        kv = kv[:, :, None].expand(length, self.kv_heads, group, self.head_dim).reshape(length, self.heads, -1)
        return kv.transpose(0, 1)[None]


def gated_mlp(h: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """Llama's MLP: down(SiLU(gate(h)) * up(h)), gate and up from one GEMM."""
    gate, up = F.linear(h, w_gate_up).chunk(2, -1)
    return F.linear(F.silu(gate) * up, w_down)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding of x [tokens, heads, D] by angles cos/sin [tokens, 1, D/2]."""
    x1, x2 = x.chunk(2, -1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)


class Timing(NamedTuple):
    """Seconds per step, whether a CUDA graph ran it, and the timed iterations."""

    seconds: float
    cuda_graph: bool
    iters: int


def measure(step: ForwardStep, batch: Batch, warmup: int = 2, iters: int | None = None,
            budget_s: float = 0.25, cuda_graph: bool = True) -> Timing:
    """Mean seconds per step over `batch` (CUDA events on a GPU, perf_counter on CPU), and
    whether a CUDA graph ran it. iters=None: enough iterations for ~budget_s (3 to 100)."""
    inputs = step.prepare(batch)
    fn: Callable[[], object] = functools.partial(step.forward, inputs)
    graph = _capture(fn) if cuda_graph and step.device.type == "cuda" else None
    if graph is not None:
        fn = graph.replay
    if iters is None:
        first = time_call(fn, step.device, warmup=warmup, iters=1)
        iters, warmup = max(3, min(100, math.ceil(budget_s / max(first, 1e-6)))), 0
    seconds = time_call(fn, step.device, warmup=warmup, iters=iters)
    return Timing(seconds, graph is not None, iters)


def _capture(fn: Callable[[], object]) -> torch.cuda.CUDAGraph | None:
    """fn as a CUDA graph (`gpu.timing.capture_graph`: two eager calls on a side stream first,
    which compile the Triton kernels); None, with a warning, if anything raises."""
    try:
        return capture_graph(fn)
    except Exception as e:  # noqa: BLE001 - any capture failure means: time eagerly
        warnings.warn(f"CUDA graph capture failed, timing eagerly: {type(e).__name__}: {e}", stacklevel=2)
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001
            pass
        return None


def kv_capacity_tokens(model: ModelSpec, tp: int = 1, gpu: str = "h100-sxm") -> int:
    """Tokens of KV cache (all layers) a server on `gpu` holds: 90% of memory less
    weights/tp and ~2 GiB of activations and workspaces, per KV byte per token."""
    cm = CostModel(model, get_gpu(gpu), tp)
    free = cm.gpu.memory_bytes * 0.9 - cm.weight_bytes - 2 * GiB
    return max(0, int(free // cm.kv_bytes_per_token))


BATCH_SIZES = (1, 4, 16, 32, 64, 128, 256)
DECODE_CTX = (128, 1024, 4096, 16384)
PREFILL_NEW = (512, 2048, 8192)
PREFILL_PRIOR = (0, 4096)


def default_grid(model_name: str | ModelSpec, tp: int = 1, gpu: str = "h100-sxm") -> list[Batch]:
    """Decode batch size x context, prefill chunks with and without prior context, several
    chunks at once, and prefill+decode mixes; only batches whose context fits the KV
    capacity of a real server on `gpu` (`kv_capacity_tokens`) and whose one-layer cache
    stays under KV_LIMIT_BYTES. 41 points for Llama-3-8B on an H100 (448k tokens of KV),
    23 for a Llama-3-70B TP-2 rank (26k tokens: its 70 GB of weights leave little). By the
    roofline, measuring them takes ~30 s and ~60 s of H100 time; memory stays under ~6 GB."""
    model = resolve_model(model_name)
    grid = [Batch(decodes(b, c)) for c in DECODE_CTX for b in BATCH_SIZES]
    grid += [Batch(prefill=((p, n),)) for n in PREFILL_NEW for p in PREFILL_PRIOR]
    grid += [Batch(prefill=((0, 512),) * 4), Batch(prefill=((0, 2048),) * 4), Batch(prefill=((2048, 2048),) * 2)]
    grid += [Batch(decodes(b, 2048), ((0, 2048),)) for b in (1, 8, 32, 128)]
    grid += [Batch(decodes(64, 1024), ((0, 512),)), Batch(decodes(256, 512), ((0, 512),)),
             Batch(decodes(16, 4096), ((4096, 2048),)), Batch(decodes(32, 4096), ((0, 8192),))]
    spread = tuple(128 + (8192 - 128) * i // 63 for i in range(64))  # contexts 128..8192, as a server holds
    grid += [Batch(spread), Batch(spread[::4], ((0, 512),))]
    return fitting(grid, model, tp, gpu)


def fitting(grid: Sequence[Batch], model: ModelSpec, tp: int = 1, gpu: str = "h100-sxm") -> list[Batch]:
    """The batches of `grid` a real server on `gpu` could hold (context within
    `kv_capacity_tokens`) whose shared one-layer cache stays under KV_LIMIT_BYTES."""
    cap = kv_capacity_tokens(model, tp, gpu)
    layer_bytes_per_token = model.kv_elements_per_token_layer(tp) * model.dtype_bytes
    return [b for b in grid if b.context_tokens <= cap and b.context_tokens * layer_bytes_per_token <= KV_LIMIT_BYTES]


# (batch size, context) of the holdout decodes: sizes and contexts default_grid has none of
HOLDOUT_DECODES = ((2, 640), (2, 12288), (8, 256), (8, 2560), (8, 12288), (24, 640), (24, 6144), (48, 256),
                   (48, 2560), (96, 256), (96, 2560), (192, 640), (192, 1536))
# (prior, new) of the holdout prefill chunks: a checkerboard of chunks 256..6144 and priors 0..8192
HOLDOUT_CHUNKS = ((0, 256), (8192, 256), (1536, 1024), (0, 3072), (8192, 3072), (1536, 6144))


def holdout_grid(model_name: str | ModelSpec, tp: int = 1, gpu: str = "h100-sxm") -> list[Batch]:
    """Points default_grid does not hold, to test a calibration fitted on it (or on part of
    these, `gpu.accuracy.holdout_accuracy`): new decode batch sizes and contexts, new chunk sizes
    and priors, several chunks, decodes mixed with a chunk, and spreads of contexts; filtered as
    default_grid (`fitting`). 30 points for Llama-3-8B on an H100, 20 for a Llama-3-70B TP-2 rank,
    26 for Qwen3-30B-A3B; by the roofline ~18 s, ~40 s and ~14 s of H100 time."""
    model = resolve_model(model_name)
    grid = [Batch(decodes(b, c)) for b, c in HOLDOUT_DECODES]
    grid += [Batch(prefill=(chunk,)) for chunk in HOLDOUT_CHUNKS]
    grid += [Batch(prefill=((0, 1024),) * 3), Batch(prefill=((1536, 3072),) * 2), Batch(prefill=((0, 256),) * 8)]
    grid += [Batch(decodes(4, 2560), ((1536, 3072),)), Batch(decodes(8, 640), ((0, 1024),)),
             Batch(decodes(24, 2560), ((1536, 256),)), Batch(decodes(96, 256), ((8192, 6144),))]
    wide = tuple(256 + (12288 - 256) * i // 47 for i in range(48))  # contexts 256..12288
    narrow = tuple(256 + (1536 - 256) * i // 23 for i in range(24))  # 256..1536, for a small cache
    grid += [Batch(wide), Batch(wide[::3], ((0, 1024),)), Batch(narrow), Batch(narrow, ((0, 256),))]
    return fitting(grid, model, tp, gpu)


def quick_grid() -> list[Batch]:
    """A few points for TINY (or TINY_MOE): decode, prefill with and without prior context, a mix."""
    return [Batch((5, 17)), Batch(prefill=((0, 8),)), Batch(prefill=((7, 5),)), Batch((9,), ((3, 4),))]


GRIDS = {"default": default_grid, "holdout": holdout_grid}


def run_grid(model_name: str | ModelSpec, tp: int = 1, device: str | torch.device | None = None,
             dtype: torch.dtype = torch.bfloat16, grid: Sequence[Batch] | None = None,
             progress: Callable[[str], object] | None = print, warmup: int = 2,
             iters: int | None = None, budget_s: float = 0.25, moe_kernel: str = "bmm") -> list[dict]:
    """Measure every batch of `grid` (default_grid) on one ForwardStep; one row per batch (a
    mixture of experts' rows name the `moe_kernel` that ran its experts)."""
    model = resolve_model(model_name)
    grid = default_grid(model, tp) if grid is None else list(grid)
    step = ForwardStep(model, tp, device, dtype, moe_kernel=moe_kernel)
    dev = step.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type
    rows = []
    for i, batch in enumerate(grid):
        t = measure(step, batch, warmup, iters, budget_s)
        rows.append({
            "model": model.name, "tp": tp, "dtype": str(dtype).removeprefix("torch."), "device": name,
            "prefill_tokens": batch.prefill_tokens, "decode_tokens": batch.decode_tokens,
            "context_tokens": batch.context_tokens, "num_seqs": batch.num_seqs,
            "measured_s": t.seconds, "cuda_graph": t.cuda_graph, "iters": t.iters,
            "batch": batch.describe(), "decode_ctx": list(batch.decode_ctx),
            "prefill": [list(c) for c in batch.prefill],
            **({"moe_kernel": moe_kernel} if model.num_experts else {}),
        })  # fmt: skip
        if dev.type == "cuda":
            torch.cuda.empty_cache()  # the point's cache and graph pool go before the next
        if progress:
            progress(f"[{i + 1}/{len(grid)}] {batch.describe():<32} {t.seconds * 1e3:9.3f} ms"
                     f"  graph={t.cuda_graph} iters={t.iters}")
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    """CLI: measure a model's grid and write the rows as JSON."""
    ap = argparse.ArgumentParser(prog="python -m gpu.forward_step", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--out", required=True, help="JSON file for the rows")
    ap.add_argument("--grid", choices=tuple(GRIDS), default="default",
                    help="default: the points a calibration is fitted to; holdout: others, to test it")
    ap.add_argument("--quick", action="store_true", help="a tiny model and 4 points (runs on CPU in seconds)")
    ap.add_argument("--moe", action="store_true", help="with --quick: a tiny mixture of experts")
    ap.add_argument("--moe-kernel", choices=MOE_KERNELS, default=None,
                    help="a mixture of experts' GEMMs: grouped (torch._grouped_mm, unpadded; the default in "
                         "bfloat16 where torch has it) or bmm (padded to the busiest expert)")
    args = ap.parse_args(argv)
    if args.moe and not args.quick:
        ap.error("--moe picks the tiny model of --quick; for a real one give --model (e.g. qwen3-30b-a3b)")
    dtype = getattr(torch, args.dtype)
    kernel = args.moe_kernel or default_moe_kernel(dtype)
    if kernel == "grouped" and kernel != default_moe_kernel(dtype):
        ap.error(f"--moe-kernel grouped needs --dtype bfloat16 and torch._grouped_mm (torch {torch.__version__})")
    if args.quick:
        rows = run_grid(TINY_MOE if args.moe else TINY, args.tp, args.device, dtype, quick_grid(), warmup=1, iters=1,
                        moe_kernel=kernel)
    else:
        try:
            model = resolve_model(args.model)
            check_buildable(model)
        except ValueError as e:  # hf_config's ConfigError included: an unknown name, a bad config
            ap.error(str(e))
        rows = run_grid(model, args.tp, args.device, dtype, GRIDS[args.grid](model, args.tp), moe_kernel=kernel)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"{len(rows)} rows -> {args.out}")


if __name__ == "__main__":
    main()
