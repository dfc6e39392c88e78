"""One synthetic forward step of a served model, timed and described in `CostModel.step_time`'s terms.

`ForwardStep` builds random weights (no checkpoint) for ONE decoder layer as a
tensor-parallel rank holds it (heads/tp, kv_heads/tp but at least 1,
intermediate/tp, full hidden) and runs it num_layers times, then the LM head on
one row per sequence (the sampled rows). Reusing one layer's weights does not
flatter the timing: a layer is hundreds of MB (~440 MB for Llama-3-8B), far
above the GPU's ~50 MB L2, so every layer streams its weights from HBM again.

Per layer: RMSNorm, fused QKV GEMM, rotary embedding (rotate-half, plain torch
ops), K/V written to a paged cache (`gpu.kernels.write_kv`), attention (the
paged Triton decode kernel for all decode tokens in one call; torch SDPA per
prefill chunk over the dense K/V of its prior context + new tokens, gathered
from the cache, with a bottom-right-aligned causal mask), output GEMM,
residual add, RMSNorm, gate_up GEMM, SiLU*mul, down GEMM, residual add.

Excluded: the TP all-reduces (two per layer; the cost model charges them
separately), sampling and everything on the host (scheduling, input prep:
`CostModel.overhead_s`), and sliding windows (attention is always full). The
embedding lookup reads the LM head's matrix (tied), a few rows per token.
Unlike vLLM, the kernels are not fused (norm + residual, SiLU*mul, rotary) and
prefill attention gathers its K/V densely and expands KV heads for SDPA; both
cost little next to the GEMMs.

One KV cache, sized for the batch, is shared by all layers: a per-layer cache
would only multiply memory, since for the batches where KV reads matter the
cache is far above L2 anyway (for tiny batches it fits L2, but then its reads
are negligible next to the weights). Block tables hold random distinct block ids.

`measure` captures the whole step as a CUDA graph on CUDA (vLLM runs decode
under CUDA graphs), falling back to eager if capture raises, and times it
with CUDA events. `run_grid` measures `default_grid`; `python -m
gpu.forward_step --model llama-3-8b --tp 1 --out rows.json` writes the rows.
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
from kvsim.gpu.timing import time_call
from kvsim.sim.engine.catalog import ModelSpec, get_gpu, get_model
from kvsim.sim.engine.cost_model import CostModel

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


class ForwardStep:
    """A model's decoder layer as one TP rank sees it, run num_layers times, plus the LM head."""

    def __init__(self, model: ModelSpec, tp: int = 1, device: str | torch.device | None = None,
                 dtype: torch.dtype = torch.bfloat16, block_size: int = 16, seed: int = 0):
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
        self.w_gate_up = self._weight(2 * inter, hidden)
        self.w_down = self._weight(hidden, inter)
        self.norm_attn, self.norm_mlp, self.norm_final = (1 + 0.1 * self._randn(hidden) for _ in range(3))
        self.lm_head = self._weight(vocab, hidden)  # also the embedding table
        half = self.head_dim // 2
        self.inv_freq = ROPE_THETA ** (-torch.arange(half, dtype=torch.float64) / half)

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
        )

    def forward(self, s: StepInputs) -> torch.Tensor:
        """The step: embedding, num_layers layers, final norm and LM head. Returns the sampled
        rows' logits [num_seqs, vocab / tp]."""
        x = F.embedding(s.token_ids, self.lm_head)
        for _ in range(self.model.num_layers):
            x = self.layer(x, s)
        h = F.rms_norm(x.index_select(0, s.sample_rows), (x.shape[1],), self.norm_final, RMS_EPS)
        return F.linear(h, self.lm_head)

    def layer(self, x: torch.Tensor, s: StepInputs) -> torch.Tensor:
        """One decoder layer over all the step's tokens x [tokens, hidden]."""
        t, hidden = x.shape
        heads, kvh, d = self.heads, self.kv_heads, self.head_dim
        qkv = F.linear(F.rms_norm(x, (hidden,), self.norm_attn, RMS_EPS), self.w_qkv, self.b_qkv)
        qk = rope(qkv[:, : (heads + kvh) * d].view(t, heads + kvh, d), s.cos, s.sin)
        q, k = qk[:, :heads], qk[:, heads:]
        v = qkv[:, (heads + kvh) * d:].view(t, kvh, d)
        write_kv(k, v, s.key_cache, s.value_cache, s.slot_mapping)
        x = x + F.linear(self.attention(q, s), self.w_o)
        gate, up = F.linear(F.rms_norm(x, (hidden,), self.norm_mlp, RMS_EPS), self.w_gate_up).chunk(2, -1)
        return x + F.linear(F.silu(gate) * up, self.w_down)

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
    """fn as a CUDA graph, after eager calls on a side stream (they compile the Triton
    kernels, as torch's capture recipe asks); None, with a warning, if anything raises."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph
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
    model = model_name if isinstance(model_name, ModelSpec) else get_model(model_name)
    grid = [Batch(decodes(b, c)) for c in DECODE_CTX for b in BATCH_SIZES]
    grid += [Batch(prefill=((p, n),)) for n in PREFILL_NEW for p in PREFILL_PRIOR]
    grid += [Batch(prefill=((0, 512),) * 4), Batch(prefill=((0, 2048),) * 4), Batch(prefill=((2048, 2048),) * 2)]
    grid += [Batch(decodes(b, 2048), ((0, 2048),)) for b in (1, 8, 32, 128)]
    grid += [Batch(decodes(64, 1024), ((0, 512),)), Batch(decodes(256, 512), ((0, 512),)),
             Batch(decodes(16, 4096), ((4096, 2048),)), Batch(decodes(32, 4096), ((0, 8192),))]
    spread = tuple(128 + (8192 - 128) * i // 63 for i in range(64))  # contexts 128..8192, as a server holds
    grid += [Batch(spread), Batch(spread[::4], ((0, 512),))]
    cap = kv_capacity_tokens(model, tp, gpu)
    layer_bytes_per_token = 2 * max(1, model.num_kv_heads // tp) * model.head_dim * model.dtype_bytes
    return [b for b in grid if b.context_tokens <= cap and b.context_tokens * layer_bytes_per_token <= KV_LIMIT_BYTES]


def quick_grid() -> list[Batch]:
    """A few points for TINY: decode, prefill with and without prior context, a mix."""
    return [Batch((5, 17)), Batch(prefill=((0, 8),)), Batch(prefill=((7, 5),)), Batch((9,), ((3, 4),))]


def run_grid(model_name: str | ModelSpec, tp: int = 1, device: str | torch.device | None = None,
             dtype: torch.dtype = torch.bfloat16, grid: Sequence[Batch] | None = None,
             progress: Callable[[str], object] | None = print, warmup: int = 2,
             iters: int | None = None, budget_s: float = 0.25) -> list[dict]:
    """Measure every batch of `grid` (default_grid) on one ForwardStep; one row per batch."""
    model = model_name if isinstance(model_name, ModelSpec) else get_model(model_name)
    grid = default_grid(model, tp) if grid is None else list(grid)
    step = ForwardStep(model, tp, device, dtype)
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
    ap.add_argument("--quick", action="store_true", help="a tiny model and 4 points (runs on CPU in seconds)")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    if args.quick:
        rows = run_grid(TINY, args.tp, args.device, dtype, quick_grid(), warmup=1, iters=1)
    else:
        rows = run_grid(args.model, args.tp, args.device, dtype)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"{len(rows)} rows -> {args.out}")


if __name__ == "__main__":
    main()
