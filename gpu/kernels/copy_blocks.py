"""Batched block copy (copy-on-write): dst block <- src block for (src, dst) pairs, every layer at once."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_CHUNK = 4096  # elements one program moves per loop iteration (8 KiB of fp16)


@triton.jit
def _copy_blocks_kernel(
    src_ptr, dst_ptr, pairs_ptr, src_plane_stride, dst_plane_stride, block_elems,
    CHUNK: tl.constexpr,
):
    # One program per (pair, plane); a plane is one layer's K or V.
    pair = tl.program_id(0).to(tl.int64)
    plane = tl.program_id(1).to(tl.int64)
    s = tl.load(pairs_ptr + 2 * pair).to(tl.int64)
    d = tl.load(pairs_ptr + 2 * pair + 1).to(tl.int64)
    src = src_ptr + plane * src_plane_stride + s * block_elems
    dst = dst_ptr + plane * dst_plane_stride + d * block_elems
    for start in range(0, block_elems, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        mask = offs < block_elems
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def planes(cache: torch.Tensor) -> torch.Tensor:
    """[..., num_blocks, block_size, H, D] as [planes, num_blocks, block elements] (a view)."""
    if cache.dim() < 4:
        raise ValueError(f"expected [..., num_blocks, block_size, heads, dim], got {tuple(cache.shape)}")
    nb = cache.shape[-4]
    elems = cache.shape[-3] * cache.shape[-2] * cache.shape[-1]
    view = cache.view(-1, nb, elems)
    if view.stride(2) != 1 or view.stride(1) != elems:
        raise ValueError("each block must be contiguous")
    return view


def check_pairs(pairs: torch.Tensor) -> None:
    if pairs.dim() != 2 or pairs.shape[1] != 2 or pairs.dtype not in (torch.int32, torch.int64) \
            or not pairs.is_contiguous():
        raise ValueError(f"pairs must be a contiguous int32/int64 [n, 2] tensor, got "
                         f"{pairs.dtype} {tuple(pairs.shape)}")


def launch_copy(src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor) -> None:
    """The copy kernel over plane views of `src` and `dst` (any devices Triton can address)."""
    if src.shape[0] != dst.shape[0] or src.shape[2] != dst.shape[2] or src.dtype != dst.dtype:
        raise ValueError(f"block layouts differ: {tuple(src.shape)} {src.dtype} vs {tuple(dst.shape)} {dst.dtype}")
    elems = src.shape[2]
    _copy_blocks_kernel[(pairs.shape[0], src.shape[0])](
        src, dst, pairs, src.stride(0), dst.stride(0), elems,
        CHUNK=min(triton.next_power_of_2(elems), MAX_CHUNK),
    )


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor) -> None:
    """For each row (s, d) of `pairs`, block d of `dst` <- block s of `src` in every plane.

    src/dst: [..., num_blocks, block_size, H, D] (may be the same tensor). No
    pair's dst may be another pair's src: the pairs run in parallel.
    """
    check_pairs(pairs)
    if pairs.shape[0]:
        launch_copy(planes(src), planes(dst), pairs)
