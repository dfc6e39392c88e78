"""Plain-torch twins of the Triton kernels: slow, obviously correct, what the kernel tests compare to."""

from __future__ import annotations

import math

import torch


def write_kv_ref(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Token t's K/V into slot slot_mapping[t] (block = slot // block_size); -1 skipped."""
    bs = key_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            key_cache[slot // bs, slot % bs] = key[t]
            value_cache[slot // bs, slot % bs] = value[t]


def copy_blocks_ref(src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor) -> None:
    """dst[..., d, :, :, :] = src[..., s, :, :, :] for each (s, d), one pair at a time."""
    for s, d in pairs.tolist():
        dst[..., d, :, :, :] = src[..., s, :, :, :].to(dst.device)


def exchange_blocks_ref(cache: torch.Tensor, pairs: torch.Tensor) -> None:
    """Swap the contents of blocks s and d for each (s, d)."""
    for s, d in pairs.tolist():
        tmp = cache[..., s, :, :, :].clone()
        cache[..., s, :, :, :] = cache[..., d, :, :, :]
        cache[..., d, :, :, :] = tmp


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """One query per head, q [Hq, D], over keys/values [n, Hkv, D], in float64 with an explicit softmax."""
    hq, d = q.shape
    group = hq // k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    k = k.double().repeat_interleave(group, dim=1)  # [n, Hq, D]
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,nhd->hn", q.double(), k) * scale
    return torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), v)


def gather_context(cache: torch.Tensor, table: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Positions [start, end) of one sequence read through its block table: [n, H, D]."""
    bs = cache.shape[1]
    pos = torch.arange(start, end, device=table.device)
    return cache[table[pos // bs].long(), pos % bs]


def decode_attention_ref(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor, *,
                         scale: float | None = None, sliding_window: int | None = None) -> torch.Tensor:
    """`gpu.kernels.decode_attention` one sequence at a time, gathering the context densely."""
    out = torch.empty_like(q)
    for b, n in enumerate(context_lens.tolist()):
        start = max(0, n - sliding_window) if sliding_window else 0
        k = gather_context(key_cache, block_tables[b], start, n)
        v = gather_context(value_cache, block_tables[b], start, n)
        out[b] = dense_attention(q[b], k, v, scale).to(q.dtype)
    return out
