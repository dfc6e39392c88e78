"""Defragmentation exchange: the contents of two blocks swapped, for disjoint (src, dst) pairs."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvsim.gpu.kernels.copy_blocks import MAX_CHUNK, check_pairs, planes


@triton.jit
def _exchange_blocks_kernel(cache_ptr, pairs_ptr, plane_stride, block_elems, CHUNK: tl.constexpr):
    pair = tl.program_id(0).to(tl.int64)
    plane = tl.program_id(1).to(tl.int64)
    a = cache_ptr + plane * plane_stride + tl.load(pairs_ptr + 2 * pair).to(tl.int64) * block_elems
    b = cache_ptr + plane * plane_stride + tl.load(pairs_ptr + 2 * pair + 1).to(tl.int64) * block_elems
    for start in range(0, block_elems, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        mask = offs < block_elems
        x = tl.load(a + offs, mask=mask)
        y = tl.load(b + offs, mask=mask)
        tl.store(a + offs, y, mask=mask)
        tl.store(b + offs, x, mask=mask)


def exchange_blocks(cache: torch.Tensor, pairs: torch.Tensor) -> None:
    """Swap blocks s and d of `cache` [..., num_blocks, block_size, H, D] for each row (s, d);
    the pairs must be disjoint (no block in two pairs)."""
    check_pairs(pairs)
    if not pairs.shape[0]:
        return
    view = planes(cache)
    elems = view.shape[2]
    _exchange_blocks_kernel[(pairs.shape[0], view.shape[0])](
        view, pairs, view.stride(0), elems, CHUNK=min(triton.next_power_of_2(elems), MAX_CHUNK),
    )
