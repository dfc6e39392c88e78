"""Write new tokens' K and V into one layer's paged cache by slot mapping (vLLM's reshape_and_cache)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    block_size,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program per token: its num_heads x head_dim K and V values, one vector each.
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    # NOTE: the slot test is broadcast by hand: the interpreter rejects scalar & tensor masks.
    mask = (h < NUM_HEADS) & (d < HEAD_DIM) & ((tl.zeros([BLOCK_H, BLOCK_D], tl.int64) + slot) >= 0)
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs + h * stride_ch + d
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key/value [T, H, D] go to slot slot_mapping[t] of key_cache/value_cache
    [num_blocks, block_size, H, D]; slots of -1 are skipped (padding)."""
    num_tokens, num_heads, head_dim = key.shape
    if value.shape != key.shape or key_cache.shape != value_cache.shape:
        raise ValueError(f"shape mismatch: key {tuple(key.shape)} value {tuple(value.shape)}, "
                         f"caches {tuple(key_cache.shape)} {tuple(value_cache.shape)}")
    if key_cache.shape[2:] != (num_heads, head_dim) or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"key {tuple(key.shape)}, cache {tuple(key_cache.shape)} and slot mapping "
                         f"{tuple(slot_mapping.shape)} disagree")
    if key.stride(2) != 1 or value.stride(2) != 1 or key_cache.stride(3) != 1 or \
            key_cache.stride() != value_cache.stride():
        raise ValueError("head_dim must be the contiguous dimension, and both caches laid out alike")
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        key_cache.shape[1],
        NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )
