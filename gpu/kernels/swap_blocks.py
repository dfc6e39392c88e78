"""Batched swap between device and host blocks, two ways (the benchmark measures both).

- "kernel": the copy kernel addresses pinned host memory directly (zero-copy
  over PCIe), one launch for every pair and layer.
- "torch": gather the blocks into one staging tensor (index_select), one
  non_blocking copy through pinned memory, scatter with index_copy_.
"""

from __future__ import annotations

import torch

from kvsim.gpu.kernels.copy_blocks import check_pairs, launch_copy, planes

SWAP_METHODS = ("kernel", "torch")


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor, method: str = "kernel") -> None:
    """For each row (s, d) of `pairs`, block d of `dst` <- block s of `src`, every plane;
    one of src/dst is usually the device cache and the other the (pinned) host pool."""
    check_pairs(pairs)
    if method not in SWAP_METHODS:
        raise ValueError(f"unknown swap method {method!r}; choose from {', '.join(SWAP_METHODS)}")
    if not pairs.shape[0]:
        return
    s, d = planes(src), planes(dst)
    if method == "kernel":
        device = dst.device if dst.device.type == "cuda" else src.device
        launch_copy(s, d, pairs.to(device, non_blocking=True))
        return
    idx_s = pairs[:, 0].to(src.device, non_blocking=True)
    idx_d = pairs[:, 1].to(dst.device, non_blocking=True)
    if src.device == dst.device:
        d.index_copy_(1, idx_d, s.index_select(1, idx_s))
    elif src.device.type == "cpu":  # host -> device: gather into pinned memory, async upload
        staged = torch.empty((s.shape[0], len(idx_s), s.shape[2]), dtype=s.dtype, pin_memory=True)
        torch.index_select(s, 1, idx_s, out=staged)
        d.index_copy_(1, idx_d, staged.to(dst.device, non_blocking=True))
    else:  # device -> host: gather on the device, async download into pinned memory
        gathered = s.index_select(1, idx_s)
        staged = torch.empty(gathered.shape, dtype=s.dtype, pin_memory=True)
        staged.copy_(gathered, non_blocking=True)
        torch.cuda.current_stream(src.device).synchronize()
        d.index_copy_(1, idx_d, staged)
