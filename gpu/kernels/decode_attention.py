"""Paged-attention decode: one query token per sequence over its block table (GQA, sliding window).

Flash-decoding: the context is cut into `num_splits` ranges of BLOCK_N-token
tiles; one program per (sequence, KV head, split) keeps an online softmax for
all query heads of its group, gathering each tile's slots through the block
table. With one split it normalises and stores the output directly; with more,
a second kernel merges the partial (max, sum, accumulator) triples.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from kvsim.gpu.kernels.mode import interpreting
from kvsim.gpu.storage import FP8_DTYPES

LOG2E = 1.4426950408889634


@triton.jit
def _decode_partial_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, ctx_ptr, out_ptr, acc_ptr, ml_ptr,
    scale_log2, v_scale, window,
    stride_qb, stride_qh,
    stride_cb, stride_cs, stride_ch,
    stride_tb,
    stride_ob, stride_oh,
    num_heads, num_splits, block_size, tiles_per_split,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, DOT_F32: tl.constexpr, FP8: tl.constexpr,
):
    # FP8 caches hold K / k_scale and V / v_scale: k_scale is folded into scale_log2, v_scale applied
    # to the accumulator once (the softmax weights sum over V's rows, so scaling V scales the output)
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b)
    start = ctx * 0
    if window > 0:
        start = tl.maximum(ctx - window, 0)
    t0 = start // BLOCK_N + split * tiles_per_split
    t1 = tl.minimum(t0 + tiles_per_split, tl.cdiv(ctx, BLOCK_N))

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    heads = kvh * GROUP + g
    gmask = g < GROUP
    dmask = d < HEAD_DIM
    qmask = gmask[:, None] & dmask[None, :]
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=qmask, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for tile in range(t0, t1):
        pos = tile * BLOCK_N + n
        valid = (pos >= start) & (pos < ctx)
        blk = tl.load(tables_ptr + b * stride_tb + pos // block_size, mask=valid, other=0).to(tl.int64)
        base = blk * stride_cb + (pos % block_size) * stride_cs + kvh * stride_ch
        kv_mask = valid[:, None] & dmask[None, :]
        k = tl.load(k_cache_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if FP8:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            qk = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
        else:
            qk = tl.dot(q, tl.trans(k)) * scale_log2
        qk = tl.where(valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m, tl.max(qk, 1))  # finite: every tile holds a valid position
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(qk - m_new[:, None])
        s = s * alpha + tl.sum(p, 1)
        if DOT_F32:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m = m_new

    if FP8:
        acc = acc * v_scale
    if SPLIT:  # partials [B, num_heads, num_splits, D] and (max, sum) pairs, both contiguous
        idx = (b * num_heads + heads) * num_splits + split
        tl.store(acc_ptr + idx[:, None] * HEAD_DIM + d[None, :], acc, mask=qmask)
        tl.store(ml_ptr + 2 * idx, m, mask=gmask)
        tl.store(ml_ptr + 2 * idx + 1, s, mask=gmask)
    else:
        out = acc / s[:, None]
        dst = out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=qmask)


@triton.jit
def _decode_reduce_kernel(
    acc_ptr, ml_ptr, out_ptr, num_heads, num_splits, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    smask = sp < num_splits
    idx = (b * num_heads + h) * num_splits + sp
    m = tl.load(ml_ptr + 2 * idx, mask=smask, other=float("-inf"))
    s = tl.load(ml_ptr + 2 * idx + 1, mask=smask, other=0.0)
    w = tl.exp2(m - tl.max(m, 0))  # empty splits have m = -inf: weight 0
    acc = tl.load(acc_ptr + idx[:, None] * HEAD_DIM + d[None, :], mask=smask[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(s * w, 0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@functools.lru_cache(maxsize=8)
def _num_sms(index: int | None) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_splits_for(batch: int, kv_heads: int, max_tokens: int, block_n: int, device: torch.device) -> int:
    """Splits that fill the GPU (about 4 programs per SM) with at least 4 tiles each; 1 on CPU."""
    tiles = triton.cdiv(max(max_tokens, 1), block_n) + 1
    if device.type != "cuda":
        return 1
    want = triton.cdiv(4 * _num_sms(device.index), batch * kv_heads)
    return max(1, min(want, triton.cdiv(tiles, 4)))


def decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    max_context: int | None = None,
    block_n: int = 64,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """Attention of q [B, num_heads, D] over each sequence's first context_lens[b] tokens
    (the last `sliding_window` of them if set), read through block_tables [B, max_blocks]
    from key/value_cache [num_blocks, block_size, num_kv_heads, D]. Returns [B, num_heads, D].
    FP8 caches (`gpu.storage.FP8_DTYPES`) hold K and V over `kv_scales` (vLLM's k_scale, v_scale).

    Query head h uses KV head h // (num_heads // num_kv_heads). `max_context` (the
    largest context length) avoids a device sync when choosing `num_splits`.
    """
    batch, num_heads, head_dim = q.shape
    _, block_size, kv_heads, cache_dim = key_cache.shape
    if cache_dim != head_dim or num_heads % kv_heads or value_cache.shape != key_cache.shape:
        raise ValueError(f"q {tuple(q.shape)} does not fit caches {tuple(key_cache.shape)} "
                         f"{tuple(value_cache.shape)} (num_heads must be a multiple of kv heads)")
    if key_cache.stride() != value_cache.stride() or key_cache.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError("head_dim must be contiguous and both caches laid out alike")
    if block_tables.shape[0] != batch or context_lens.shape != (batch,) or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables {tuple(block_tables.shape)} / context_lens "
                         f"{tuple(context_lens.shape)} do not match batch {batch}")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    out = torch.empty_like(q)
    if batch == 0:
        return out
    group = num_heads // kv_heads
    window = int(sliding_window or 0)
    if max_context is None:
        max_context = int(context_lens.max())
    span = min(max_context, window) if window else max_context
    if num_splits is None:
        num_splits = num_splits_for(batch, kv_heads, span, block_n, q.device)
    tiles = triton.cdiv(max(span, 1), block_n) + (1 if window else 0)  # a window may straddle a tile
    tiles_per_split = triton.cdiv(tiles, num_splits)
    num_splits = triton.cdiv(tiles, tiles_per_split)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    fp8 = key_cache.dtype in FP8_DTYPES
    if not fp8 and tuple(kv_scales) != (1.0, 1.0):
        raise ValueError(f"kv_scales {kv_scales}: only an FP8 cache is scaled")
    split = num_splits > 1
    if split:
        acc = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        ml = torch.empty((batch, num_heads, num_splits, 2), dtype=torch.float32, device=q.device)
    else:
        acc = ml = out  # unused
    block_d = max(16, triton.next_power_of_2(head_dim))
    # NOTE: fp32 caches get exact (ieee) fp32 dots; so does bf16 under the interpreter,
    # whose tl.dot multiplies bf16's raw bits.
    dot_f32 = q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and interpreting())
    _decode_partial_kernel[(batch, kv_heads, num_splits)](
        q, key_cache, value_cache, block_tables, context_lens, out, acc, ml,
        scale * LOG2E * kv_scales[0], kv_scales[1], window,
        q.stride(0), q.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        num_heads, num_splits, block_size, tiles_per_split,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_N=block_n, SPLIT=split, DOT_F32=dot_f32, FP8=fp8,
        num_warps=4,
    )
    if split:
        _decode_reduce_kernel[(batch, num_heads)](
            acc, ml, out, num_heads, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
        )
    return out
