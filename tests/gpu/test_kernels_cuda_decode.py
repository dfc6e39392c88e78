"""Paged decode attention against the float64 dense reference in `gpu.reference`, on CUDA, at the
catalog models' shapes (see `cuda_cases`): split-K, GQA, sliding window, contexts up to 32k,
batch 36, compared by a per-sequence relative error bound of a few units of the dtype's
rounding, plus needle tests that fail loudly if a masked position (outside the window,
past the context) is attended to or a valid one dropped; and K/V written by write_kv
through a PagedKVStorage, then decoded.
"""

from __future__ import annotations

import math

import pytest
import torch
from cuda_cases import (
    BLOCK_SIZES,
    CUDA_MARKS,
    DTYPES,
    MODELS,
    SIZES,
    Shape,
    ids,
    perm,
    randn,
    shape_of,
)
from gpu_env import DEVICE

from kvsim.gpu.kernels import decode_attention, write_kv
from kvsim.gpu.reference import decode_attention_ref, dense_attention, gather_context
from kvsim.gpu.storage import PagedKVStorage

pytestmark = CUDA_MARKS

# Decode tolerance per dtype: (atol, rtol) elementwise, and the bound on each sequence's
# ||out - ref|| / ||ref||. The kernel rounds softmax weights and the output to the dtype
# (unit roundoff 2^-11 fp16, 2^-8 bf16); a dropped 64-token tile of an 8k context moves the
# output by ~9 % in that norm.
TOL = {torch.float16: (2e-3, 5e-3, 2e-3), torch.bfloat16: (1.6e-2, 2e-2, 1.5e-2)}



def _paged(s: Shape, dtype, bs: int, ctx: list[int], seed: int, q_scale: float = 1.0):
    """q, shuffled physical K/V blocks and each sequence's table; each table has one more
    (allocated, filled) block than its context needs, so positions past the context exist."""
    pages = [n // bs + 1 for n in ctx]
    width = -(-max(pages) // 16) * 16
    nb = 1 + sum(pages)
    kc = randn((nb, bs, s.kv_heads, s.head_dim), dtype, seed=seed)
    vc = randn((nb, bs, s.kv_heads, s.head_dim), dtype, seed=seed + 1)
    phys = perm(nb - 1, seed, start=1)
    tables = torch.zeros((len(ctx), width), dtype=torch.int32)
    for b, p in enumerate(pages):
        tables[b, :p] = torch.tensor(phys[:p], dtype=torch.int32)
        phys = phys[p:]
    q = (randn((len(ctx), s.heads, s.head_dim), torch.float32, seed=seed + 2) * q_scale).to(dtype)
    return q, kc, vc, tables.to(DEVICE), torch.tensor(ctx, dtype=torch.int32, device=DEVICE)


def _dense_ref(q, kc, vc, tables, ctx, window) -> torch.Tensor:
    """float64 [B, H, D]: each sequence's (windowed) context gathered densely, explicit softmax."""
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for b, n in enumerate(ctx.tolist()):
        start = max(0, n - window) if window else 0
        out[b] = dense_attention(q[b], gather_context(kc, tables[b], start, n),
                                 gather_context(vc, tables[b], start, n))
    return out


def _assert_close(out: torch.Tensor, ref: torch.Tensor, dtype, what: str) -> None:
    atol, rtol, rel = TOL[dtype]
    assert out.dtype == dtype and bool(torch.isfinite(out).all()), what
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")
    err = (out.double() - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1)
    worst = int(err.argmax())
    assert float(err[worst]) <= rel, f"{what}: sequence {worst} relative error {float(err[worst]):.2e} > {rel}"


def _batch_contexts(bs: int, window: int | None, n: int, top: int, seed: int) -> list[int]:
    """Edge lengths (1, around a block, a 64-token tile, the window) then random ones up to `top`."""
    edges = [1, 2, bs - 1, bs, bs + 1, 63, 64, 65, top - 1, top]
    if window:
        edges += [window - 1, window, window + 1]
    edges = sorted({c for c in edges if 1 <= c <= top})[:n // 2]
    g = torch.Generator().manual_seed(seed)
    return edges + torch.randint(1, top + 1, (n - len(edges),), generator=g).tolist()


@pytest.mark.parametrize("bs", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("model", MODELS)
def test_decode_attention_batch(model, dtype, bs):
    """A decode batch of 36 sequences of 1..8k tokens (edge lengths included), the split count
    the kernel picks; windowed for Mistral. Also `decode_attention_ref`'s dtype output."""
    s = shape_of(model)
    ctx = _batch_contexts(bs, s.window, SIZES.batch, SIZES.max_ctx, seed=bs)
    assert len(ctx) == SIZES.batch
    q, kc, vc, tables, lens = _paged(s, dtype, bs, ctx, seed=bs, q_scale=2.0)
    ref = _dense_ref(q, kc, vc, tables, lens, s.window)
    out = decode_attention(q, kc, vc, tables, lens, sliding_window=s.window, max_context=max(ctx))
    _assert_close(out, ref, dtype, f"{model} {dtype} bs {bs}")
    ref_dtype = decode_attention_ref(q, kc, vc, tables, lens, sliding_window=s.window)
    _assert_close(ref_dtype, ref, dtype, "decode_attention_ref itself")


@pytest.mark.parametrize("bs", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("model", MODELS)
def test_decode_attention_long_context_splits(model, dtype, bs):
    """32k, 16k+7 and 1 tokens: one split, an odd forced count, and the kernel's own choice
    (many splits for a small batch) all agree with the reference; max_context left to the kernel."""
    s = shape_of(model)
    ctx = [SIZES.long_ctx, SIZES.long_ctx // 2 + 7, 1]
    q, kc, vc, tables, lens = _paged(s, dtype, bs, ctx, seed=100 + bs, q_scale=2.0)
    ref = _dense_ref(q, kc, vc, tables, lens, s.window)
    for splits in (None, 1, 7):
        out = decode_attention(q, kc, vc, tables, lens, sliding_window=s.window, num_splits=splits)
        _assert_close(out, ref, dtype, f"{model} {dtype} bs {bs} num_splits {splits}")


def _needle_cases(bs: int, window: int | None, long: int) -> list[tuple[int, int, bool]]:
    """(context length, needle position, whether the position is attended)."""
    cases = [(1, 0, True), (1, 1, False), (bs, bs - 1, True), (bs, bs, False), (65, 64, True), (65, 63, True),
             (64, 64, False), (long, 0, not window), (long, long - 1, True), (long, long, False),
             (long, long // 2, not window or long // 2 >= long - window)]
    if window:
        w = window
        cases += [(w + 100, 99, False), (w + 100, 100, True), (w + 100, w + 99, True), (w + 100, w + 100, False),
                  (w, 0, True), (w + 1, 0, False), (w + 1, 1, True), (3 * w + 7, 2 * w + 6, False),
                  (3 * w + 7, 2 * w + 7, True)]
    return cases


@pytest.mark.parametrize("bs", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("model", MODELS)
def test_decode_attention_needles(model, dtype, bs):
    """One key per sequence aligned with its query (score 30, every head of every group):
    the output is that token's value (8.0) exactly when the position is in the context (and
    window), and never when it lies past the context or before the window; for 1, 7 and the
    kernel's own split counts."""
    s = shape_of(model)
    cases = _needle_cases(bs, s.window, SIZES.needle_ctx)
    ctx = [c for c, _, _ in cases]
    q, kc, vc, tables, lens = _paged(s, dtype, bs, ctx, seed=200 + bs)
    d = s.head_dim
    u = randn((len(cases), d), torch.float32, seed=3)
    u = u / u.norm(dim=1, keepdim=True) * math.sqrt(d)  # |u|^2 = d
    q[:] = u[:, None, :].to(dtype)
    for b, (_, pos, _) in enumerate(cases):
        blk, off = int(tables[b, pos // bs]), pos % bs
        kc[blk, off] = (u[b] * (30 / math.sqrt(d))).to(dtype)  # score = q.k / sqrt(d) = 30
        vc[blk, off] = 8.0
    ref = _dense_ref(q, kc, vc, tables, lens, s.window)
    for splits in (None, 1, 7):
        out = decode_attention(q, kc, vc, tables, lens, sliding_window=s.window, num_splits=splits)
        _assert_close(out, ref, dtype, f"{model} {dtype} bs {bs} num_splits {splits}")
        for b, (n, pos, seen) in enumerate(cases):
            o = out[b].float()
            what = f"context {n}, needle at {pos}, num_splits {splits}"
            if seen:
                assert bool(((o - 8).abs() < 0.05).all()), f"{what}: needle not attended"
            else:
                assert float(o.max()) < 6, f"{what}: needle outside the context/window attended"


@pytest.mark.parametrize("bs", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
def test_write_then_decode_through_storage(dtype, bs):
    """Llama-3-8B: a 4k-token prompt and a 1k one written with write_kv into the last layer of a
    PagedKVStorage (shuffled blocks), then decoded: equal to dense attention over the original
    K/V tensors (no gather through the cache in the reference)."""
    s = shape_of("llama-3-8b")
    lens = [SIZES.max_ctx // 2, SIZES.max_ctx // 8 + 3]
    pages = [-(-n // bs) for n in lens]
    st = PagedKVStorage(s.layers, sum(pages) + 1, bs, s.kv_heads, s.head_dim, dtype=dtype, device=DEVICE)
    phys = perm(sum(pages), seed=bs, start=1)
    tables = torch.zeros((2, max(pages)), dtype=torch.int32)
    keys, values = [], []
    for b, (n, p) in enumerate(zip(lens, pages, strict=True)):
        tables[b, :p] = torch.tensor(phys[:p], dtype=torch.int32)
        phys = phys[p:]
        k = randn((n, s.kv_heads, s.head_dim), dtype, seed=10 + b)
        v = randn((n, s.kv_heads, s.head_dim), dtype, seed=20 + b)
        pos = torch.arange(n)
        slots = (tables[b, pos // bs].long() * bs + pos % bs).to(DEVICE)
        write_kv(k, v, st.key(s.layers - 1), st.value(s.layers - 1), slots)
        keys.append(k)
        values.append(v)
    tables = tables.to(DEVICE)
    q = randn((2, s.heads, s.head_dim), dtype, seed=30)
    out = decode_attention(q, st.key(s.layers - 1), st.value(s.layers - 1), tables,
                           torch.tensor(lens, dtype=torch.int32, device=DEVICE))
    ref = torch.stack([dense_attention(q[b], keys[b], values[b]) for b in range(2)])
    _assert_close(out, ref, dtype, f"llama-3-8b {dtype} bs {bs}")
    assert int(st.key(0).count_nonzero()) == 0  # other layers untouched


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("model", MODELS)
def test_decode_attention_fp8_cache(model, fp8):
    """An FP8 cache holding K / k_scale and V / v_scale (vLLM's --kv-cache-dtype fp8): the kernel's
    output against the float64 reference over the values the cache stands for (FP8 x scale), with
    fp16's tolerance, for one split and several."""
    s = shape_of(model)
    bs = BLOCK_SIZES[0]
    ctx = _batch_contexts(bs, s.window, SIZES.batch, SIZES.max_ctx, seed=7)
    q, kc, vc, tables, lens = _paged(s, torch.float16, bs, ctx, seed=7, q_scale=2.0)
    scales = (0.5, 2.0)
    k8, v8 = (kc / scales[0]).to(fp8), (vc / scales[1]).to(fp8)
    ref = _dense_ref(q, k8.to(torch.float16) * scales[0], v8.to(torch.float16) * scales[1], tables, lens, s.window)
    for splits in (None, 1):
        out = decode_attention(q, k8, v8, tables, lens, sliding_window=s.window, max_context=max(ctx),
                               num_splits=splits, kv_scales=scales)
        _assert_close(out, ref, torch.float16, f"{model} {fp8} num_splits {splits}")
