"""Write new tokens' K and V into a layer's paged cache by slot mapping (vLLM's reshape_and_cache),
or into every layer's at once in one launch (`write_kv_layers`: a replay writes all its layers a step)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    stride_kl, stride_vl, stride_cl,
    block_size, inv_k, inv_v,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    SCALED: tl.constexpr,
):
    # One program per (token, layer): its num_heads x head_dim K and V values, one vector each.
    t = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    key_ptr += layer * stride_kl
    value_ptr += layer * stride_vl
    k_cache_ptr += layer * stride_cl
    v_cache_ptr += layer * stride_cl
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    # NOTE: the slot test is broadcast by hand: the interpreter rejects scalar & tensor masks.
    mask = (h < NUM_HEADS) & (d < HEAD_DIM) & ((tl.zeros([BLOCK_H, BLOCK_D], tl.int64) + slot) >= 0)
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs + h * stride_ch + d
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    if SCALED:  # an FP8 cache: each value over its plane's scale (vLLM's reshape_and_cache with k_scale, v_scale)
        k = k * inv_k
        v = v * inv_v
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


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
    _launch(key, value, key_cache, value_cache, slot_mapping, 1, (0, 0, 0))


def write_kv_layers(values: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                    kv_scales: tuple[float, float] | None = None) -> None:
    """values [T, L, 2, H, D] (each token's K and V on every layer) go to slot slot_mapping[t] of
    cache [L, 2, num_blocks, block_size, H, D] (`PagedKVStorage.gpu`'s layout), every layer in one
    launch: `write_kv` on each layer's K and V, without a launch a layer. Slots of -1 are skipped.
    `kv_scales` (an FP8 cache's k_scale, v_scale): each K and V value is stored over its scale."""
    num_tokens, layers, two, num_heads, head_dim = values.shape
    if two != 2 or cache.shape[:2] != (layers, 2) or cache.shape[4:] != (num_heads, head_dim):
        raise ValueError(f"values {tuple(values.shape)} and cache {tuple(cache.shape)} disagree: "
                         "need [T, L, 2, H, D] and [L, 2, blocks, block_size, H, D]")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot mapping {tuple(slot_mapping.shape)} for {num_tokens} tokens")
    if values.stride(4) != 1 or cache.stride(5) != 1:
        raise ValueError("head_dim must be the contiguous dimension")
    if num_tokens == 0:
        return
    key, value = values[:, :, 0], values[:, :, 1]  # [T, L, H, D]
    key_cache, value_cache = cache[:, 0], cache[:, 1]  # [L, blocks, block_size, H, D]
    _launch(key.select(1, 0), value.select(1, 0), key_cache[0], value_cache[0], slot_mapping, layers,
            (key.stride(1), value.stride(1), key_cache.stride(0)), kv_scales)


def _launch(key, value, key_cache, value_cache, slot_mapping, layers: int, layer_strides: tuple[int, int, int],
            kv_scales: tuple[float, float] | None = None) -> None:
    """The kernel over every (token, layer): layer 0's tensors and each layer's stride in them."""
    num_tokens, num_heads, head_dim = key.shape
    _write_kv_kernel[(num_tokens, layers)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        *layer_strides,
        key_cache.shape[1], 1.0 / kv_scales[0] if kv_scales else 1.0, 1.0 / kv_scales[1] if kv_scales else 1.0,
        NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        SCALED=kv_scales is not None,
    )
