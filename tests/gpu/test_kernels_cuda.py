"""Every Triton kernel against its plain-torch twin in `gpu.reference`, on CUDA, at the catalog models' shapes.

Shapes come from `sim.engine.catalog` (query heads, KV heads, head dim, layers, sliding
window): Llama-3-8B (32/8 heads, GQA group 4), Llama-3-70B sharded for TP2
(32/4 heads per GPU, group 8, 80 layers), Qwen2.5-7B (28/4, group 7: not a power
of two) and Mistral-7B (32/8, sliding window 4096); fp16 and bf16; block sizes
16 and 32. Data movement (write_kv, copy_blocks, exchange_blocks, swap_blocks
both methods and both ways) must be bit-exact; decode attention (split-K, GQA,
sliding window, contexts up to 32k, batch 36) is compared with the float64
dense reference by a per-sequence relative error bound of a few units of the
dtype's rounding, plus needle tests that fail loudly if a masked position
(outside the window, past the context) is attended to or a valid one dropped.

Every test is marked `cuda`: without a GPU the conftest skips them. Setting
KVSIM_CUDA_TESTS_TINY=1 runs the same test bodies at tiny shapes (same group
sizes, block sizes and dtypes; small heads, contexts and windows), on CPU under
Triton's interpreter when there is no GPU (about two minutes), to check the tests
themselves:

    KVSIM_CUDA_TESTS_TINY=1 python -m pytest tests/gpu/test_kernels_cuda.py
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import pytest
import torch
from gpu_env import DEVICE, HAS_CUDA

from gpu.kernels import copy_blocks, decode_attention, exchange_blocks, swap_blocks, write_kv
from gpu.reference import (
    copy_blocks_ref,
    decode_attention_ref,
    dense_attention,
    exchange_blocks_ref,
    gather_context,
    write_kv_ref,
)
from gpu.storage import PagedKVStorage
from sim.engine.catalog import get_model

TINY = os.environ.get("KVSIM_CUDA_TESTS_TINY", "") == "1"
if not TINY:
    pytestmark = pytest.mark.cuda


@dataclass(frozen=True)
class Shape:
    """One GPU's share of a model: what the kernels see."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    window: int | None


@dataclass(frozen=True)
class Sizes:
    """How big the tests are: real (CUDA) or tiny (interpreter)."""

    blocks: int  # device blocks for the block-op tests
    cpu_blocks: int
    pairs: int
    write_tokens: tuple[int, ...]
    batch: int  # decode batch
    max_ctx: int  # largest context in the decode batch
    long_ctx: int  # the long-context test's longest context
    needle_ctx: int
    window: int  # the sliding window of a model that has one


REAL = Sizes(blocks=384, cpu_blocks=48, pairs=48, write_tokens=(1, 129, 2048), batch=36, max_ctx=8192,
             long_ctx=32768, needle_ctx=8192 + 5, window=0)  # window 0: the model's own
SMALL = Sizes(blocks=24, cpu_blocks=8, pairs=5, write_tokens=(1, 7, 33), batch=6, max_ctx=100,
              long_ctx=300, needle_ctx=150, window=40)
SIZES = SMALL if TINY else REAL

MODELS = ("llama-3-8b", "llama-3-70b-tp2", "qwen2.5-7b", "mistral-7b")
MOVE_MODELS = ("llama-3-8b", "llama-3-70b-tp2")  # block ops only see layers x KV heads x head dim
DTYPES = (torch.float16, torch.bfloat16)
BLOCK_SIZES = (16, 32)
# Decode tolerance per dtype: (atol, rtol) elementwise, and the bound on each sequence's
# ||out - ref|| / ||ref||. The kernel rounds softmax weights and the output to the dtype
# (unit roundoff 2^-11 fp16, 2^-8 bf16); a dropped 64-token tile of an 8k context moves the
# output by ~9 % in that norm.
TOL = {torch.float16: (2e-3, 5e-3, 2e-3), torch.bfloat16: (1.6e-2, 2e-2, 1.5e-2)}


def shape_of(name: str) -> Shape:
    """The catalog model `name` (a "-tpN" suffix: one of N tensor-parallel shards), or its tiny stand-in."""
    base, _, tp = name.partition("-tp")
    m = get_model(base)
    tp = int(tp or 1)
    heads, kv = m.num_heads // tp, m.num_kv_heads // tp
    window = m.sliding_window
    if TINY:
        group = heads // kv
        kv = min(kv, 2)
        return Shape(2, kv * group, kv, 32, SIZES.window if window else None)
    return Shape(m.num_layers, heads, kv, m.head_dim, window)


def ids(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def randn(shape, dtype, seed: int, device=DEVICE) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=g, device=device, dtype=dtype)


def perm(n: int, seed: int, start: int = 0) -> list[int]:
    """start..start+n-1 shuffled (seeded, on the host)."""
    return (torch.randperm(n, generator=torch.Generator().manual_seed(seed)) + start).tolist()


def sync() -> None:
    if HAS_CUDA:
        torch.cuda.synchronize()


# ---------------------------------------------------------------- data movement


@pytest.mark.parametrize("tokens", SIZES.write_tokens)
@pytest.mark.parametrize("bs", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("model", MOVE_MODELS)
def test_write_kv_bit_exact(model, dtype, bs, tokens):
    """K/V as strided views of a fused qkv projection, scattered to random slots (some -1)
    of caches full of other data: equal to the reference everywhere, untouched elsewhere."""
    s = shape_of(model)
    nb = max(SIZES.blocks, -(-2 * tokens // bs) + 1)
    qkv = randn((tokens, s.heads + 2 * s.kv_heads, s.head_dim), dtype, seed=tokens)
    key, value = qkv[:, s.heads:s.heads + s.kv_heads], qkv[:, s.heads + s.kv_heads:]
    slots = torch.tensor(perm(nb * bs, seed=bs)[:tokens], device=DEVICE)
    if tokens > 1:
        slots[::7] = -1  # padding
    kc = randn((nb, bs, s.kv_heads, s.head_dim), dtype, seed=1)
    vc = randn((nb, bs, s.kv_heads, s.head_dim), dtype, seed=2)
    k_ref, v_ref = kc.clone(), vc.clone()
    write_kv(key, value, kc, vc, slots)
    write_kv_ref(key, value, k_ref, v_ref, slots)
    assert torch.equal(kc, k_ref) and torch.equal(vc, v_ref)
    t = int(torch.nonzero(slots >= 0)[-1])
    slot = int(slots[t])
    assert torch.equal(kc[slot // bs, slot % bs], key[t]) and torch.equal(vc[slot // bs, slot % bs], value[t])


def _storage(s: Shape, dtype, bs: int, blocks: int, cpu_blocks: int = 0, seed: int = 0) -> PagedKVStorage:
    st = PagedKVStorage(s.layers, blocks, bs, s.kv_heads, s.head_dim, num_cpu_blocks=cpu_blocks, dtype=dtype,
                        device=DEVICE)
    st.gpu.copy_(randn(st.gpu.shape, dtype, seed=seed))
    if cpu_blocks:
        st.cpu.copy_(randn(st.cpu.shape, dtype, seed=seed + 1))  # generated on the device: faster
    return st


def _cow_pairs(nb: int, n: int, seed: int) -> torch.Tensor:
    """n copy pairs among blocks 1..nb-1: distinct dsts, none of them a src; the last few
    fork one src to several dsts (copy-on-write of a shared prefix)."""
    p = perm(nb - 1, seed, start=1)
    src, dst = p[:n], p[n:2 * n]
    src[-3:] = [src[0]] * 3
    return torch.tensor(list(zip(src, dst, strict=True)), device=DEVICE)


@pytest.mark.parametrize("bs", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("model", MOVE_MODELS)
def test_copy_blocks_bit_exact(model, dtype, bs):
    s = shape_of(model)
    st = _storage(s, dtype, bs, SIZES.blocks)
    want = st.gpu.clone()
    for i, index_dtype in enumerate((torch.int64, torch.int32)):
        pairs = _cow_pairs(SIZES.blocks, SIZES.pairs, seed=bs + i).to(index_dtype)
        copy_blocks(st.gpu, st.gpu, pairs)
        copy_blocks_ref(want, want, pairs)
        assert torch.equal(st.gpu, want)
    # and between two tensors (src untouched)
    other = torch.zeros_like(st.gpu)
    pairs = _cow_pairs(SIZES.blocks, SIZES.pairs, seed=bs + 2)
    copy_blocks(st.gpu, other, pairs)
    ref = torch.zeros_like(st.gpu)
    copy_blocks_ref(st.gpu, ref, pairs)
    assert torch.equal(other, ref) and torch.equal(st.gpu, want)


@pytest.mark.parametrize("bs", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("model", MOVE_MODELS)
def test_exchange_blocks_bit_exact(model, dtype, bs):
    s = shape_of(model)
    st = _storage(s, dtype, bs, SIZES.blocks)
    before = st.gpu.clone()
    want = st.gpu.clone()
    p = perm(SIZES.blocks, seed=bs)
    pairs = torch.tensor(p[:2 * SIZES.pairs], device=DEVICE).view(-1, 2)
    exchange_blocks(st.gpu, pairs)
    exchange_blocks_ref(want, pairs)
    assert torch.equal(st.gpu, want)
    a, b = int(pairs[0, 0]), int(pairs[0, 1])
    assert torch.equal(st.gpu[:, :, a], before[:, :, b]) and torch.equal(st.gpu[:, :, b], before[:, :, a])
    exchange_blocks(st.gpu, pairs.flip(1).contiguous().to(torch.int32))  # and back
    assert torch.equal(st.gpu, before)


@pytest.mark.parametrize("method", ["kernel", "torch"])
@pytest.mark.parametrize("bs", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("model", MOVE_MODELS)
def test_swap_blocks_bit_exact_both_ways(model, dtype, bs, method):
    """Device -> pinned host pool, then host -> device, against the reference copy."""
    s = shape_of(model)
    st = _storage(s, dtype, bs, SIZES.blocks, SIZES.cpu_blocks)
    n = min(SIZES.pairs, SIZES.cpu_blocks)
    gpu_ids = perm(SIZES.blocks - 1, seed=bs, start=1)
    out_pairs = torch.tensor(list(zip(gpu_ids[:n], perm(SIZES.cpu_blocks, seed=bs + 1)[:n], strict=True)))
    want = st.cpu.clone()
    copy_blocks_ref(st.gpu, want, out_pairs)
    swap_blocks(st.gpu, st.cpu, out_pairs.to(DEVICE) if method == "kernel" else out_pairs, method)
    sync()  # the kernel writes the pinned pool asynchronously
    assert torch.equal(st.cpu, want)

    st.cpu.copy_(randn(st.cpu.shape, dtype, seed=7))
    in_pairs = torch.tensor(list(zip(perm(SIZES.cpu_blocks, seed=bs + 2)[:n], gpu_ids[-n:], strict=True)))
    want = st.gpu.clone()
    copy_blocks_ref(st.cpu, want, in_pairs)
    swap_blocks(st.cpu, st.gpu, in_pairs.to(DEVICE) if method == "kernel" else in_pairs, method)
    assert torch.equal(st.gpu, want)


def test_block_ops_address_past_2g_elements():
    """A storage of more than 2^31 elements (4.3 GB of fp16, Llama-3-70B TP2 layers): the
    highest blocks are copied and exchanged correctly (64-bit offsets)."""
    s = shape_of("llama-3-70b-tp2")
    bs = 16
    per_block = s.layers * 2 * bs * s.kv_heads * s.head_dim
    nb = SIZES.blocks if TINY else (1 << 31) // per_block + 64
    assert TINY or nb * per_block > 1 << 31
    st = _storage(s, torch.float16, bs, nb)
    want = st.gpu.clone()
    top = [nb - 1, nb - 2, nb - 3, nb - 4]
    copy_pairs = torch.tensor([[top[0], 1], [2, top[1]], [top[2], 3]], device=DEVICE)
    copy_blocks(st.gpu, st.gpu, copy_pairs)
    copy_blocks_ref(want, want, copy_pairs)
    assert torch.equal(st.gpu, want)
    ex_pairs = torch.tensor([[top[3], 5], [top[0], 6]], device=DEVICE)
    exchange_blocks(st.gpu, ex_pairs)
    exchange_blocks_ref(want, ex_pairs)
    assert torch.equal(st.gpu, want)


# ---------------------------------------------------------------- decode attention


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
