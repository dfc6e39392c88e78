"""Count cached values that differ from what their prefix keys imply (the replay's check, fused).

Value e of a position with key k is ((k * salt[e]) >> 61 & 7) - 4) / 4 (`gpu.values`); one
program reads a tile of slots of one plane, derives the expected values in registers and
counts mismatches, so a check costs one read of the cache and nothing else.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _count_wrong_kernel(planes_ptr, slots_ptr, keys_ptr, salts_ptr, out_ptr, n, plane_stride, width, k_scale, v_scale,
                        BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr):
    tile = tl.program_id(0)
    plane = tl.program_id(1).to(tl.int64)
    t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < n
    slot = tl.load(slots_ptr + t, mask=tmask, other=0)
    key = tl.load(keys_ptr + t, mask=tmask, other=0)
    wrong = tl.zeros([BLOCK_T], tl.int32)
    scale = tl.where(plane % 2 == 0, k_scale, v_scale)  # (an FP8 cache's value over its plane's scale; else 1)
    for w0 in range(0, width, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)
        wmask = w < width
        salt = tl.load(salts_ptr + plane * width + w, mask=wmask, other=0)
        top = ((key[:, None] * salt[None, :]) >> 61) & 7
        want = (top - 4).to(tl.float32) * 0.25
        mask = tmask[:, None] & wmask[None, :]
        got = tl.load(planes_ptr + plane * plane_stride + slot[:, None] * width + w[None, :], mask=mask, other=0.0)
        wrong += tl.sum(((got.to(tl.float32) * scale != want) & mask).to(tl.int32), 1)
    tl.store(out_ptr + tl.program_id(1) * n + t, wrong, mask=tmask)


def count_wrong(planes: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, salts: torch.Tensor,
                kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    """Wrong values per (plane, token): planes [P, num_slots, W] (contiguous slots; K planes even, V
    odd), slots and int64 keys [N] on its device, int64 salts [P, W]; an FP8 cache's planes hold values
    over `kv_scales` (K, V). Returns int32 [P, N]."""
    p, _, width = planes.shape
    if planes.stride(2) != 1 or planes.stride(1) != width or salts.shape != (p, width) or keys.shape != slots.shape:
        raise ValueError(f"planes {tuple(planes.shape)}, salts {tuple(salts.shape)}, slots {tuple(slots.shape)} "
                         f"and keys {tuple(keys.shape)} disagree")
    n = slots.shape[0]
    out = torch.zeros((p, n), dtype=torch.int32, device=planes.device)
    if n:
        block_w = min(triton.next_power_of_2(width), 256)
        block_t = max(1, 4096 // block_w)
        _count_wrong_kernel[(triton.cdiv(n, block_t), p)](
            planes, slots, keys, salts.contiguous(), out, n, planes.stride(0), width, float(kv_scales[0]),
            float(kv_scales[1]), BLOCK_T=block_t, BLOCK_W=block_w,
        )
    return out
