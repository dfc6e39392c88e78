"""Paged KV storage: every layer's K and V blocks on the device, plus a CPU swap pool and the
host tier of KV offloading.

One tensor holds all layers, so a block op (copy, swap, exchange) is one kernel
launch over every layer; per-layer K and V are views of it:

    gpu[layer, kv, block, offset, head, dim]        kv: 0 = K, 1 = V
         \\___ key(layer) / value(layer): [num_blocks, block_size, num_kv_heads, head_dim]

    one (layer, kv) plane, flattened to slots:
    block 0              block 1              ...
    | off 0 | off 1 | ...| off 0 | off 1 | ...|
      slot = block * block_size + offset;  a slot holds num_kv_heads * head_dim values

Block 0 is vLLM's null block (never written by the manager). The CPU pool (and
the host tier) have the same layout with `num_cpu_blocks` (`num_host_blocks`)
blocks, pinned when CUDA is available.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch


class PagedKVStorage:
    """K/V blocks for `num_layers` layers on `device`; `num_cpu_blocks` swap blocks and `num_host_blocks`
    offloaded blocks on the host."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        num_cpu_blocks: int = 0,
        num_host_blocks: int = 0,
        dtype: torch.dtype = torch.float16,
        device: str | torch.device = "cuda",
    ):
        for name, v in (("num_layers", num_layers), ("num_blocks", num_blocks), ("block_size", block_size),
                        ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        for name, v in (("num_cpu_blocks", num_cpu_blocks), ("num_host_blocks", num_host_blocks)):
            if v < 0:
                raise ValueError(f"{name} must be >= 0, got {v}")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim, self.num_cpu_blocks = num_kv_heads, head_dim, num_cpu_blocks
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        self.gpu = torch.zeros(shape, dtype=dtype, device=self.device)
        pin = self.device.type == "cuda" and torch.cuda.is_available()
        cpu_shape = (num_layers, 2, num_cpu_blocks, block_size, num_kv_heads, head_dim)
        self.cpu = torch.zeros(cpu_shape, dtype=dtype, device="cpu", pin_memory=pin)
        self.num_host_blocks = num_host_blocks
        host_shape = (num_layers, 2, num_host_blocks, block_size, num_kv_heads, head_dim)
        self.host = torch.zeros(host_shape, dtype=dtype, device="cpu", pin_memory=pin)
        self._files: FileBlocks | None = None

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers, K and V (what a block op moves)."""
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.gpu.element_size()

    def file_blocks(self) -> FileBlocks:
        """The file tier's blocks, one file each in a temporary folder (made on first use)."""
        if self._files is None:
            self._files = FileBlocks(self.host.shape[:2] + self.host.shape[3:], self.dtype)
        return self._files

    def key(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s K cache, [num_blocks, block_size, num_kv_heads, head_dim]."""
        return self.gpu[layer, 0]

    def value(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s V cache, [num_blocks, block_size, num_kv_heads, head_dim]."""
        return self.gpu[layer, 1]

    def cpu_key(self, layer: int) -> torch.Tensor:
        return self.cpu[layer, 0]

    def cpu_value(self, layer: int) -> torch.Tensor:
        return self.cpu[layer, 1]

    def slots(self) -> torch.Tensor:
        """Every (layer, kv) plane as slots: [num_layers, 2, num_blocks * block_size, heads, dim] (a view)."""
        return self.gpu.view(self.num_layers, 2, -1, self.num_kv_heads, self.head_dim)


class FileBlocks:
    """The file tier of KV offloading: each block (all layers, K and V) in its own file, written from
    and read into host-tier blocks, as vLLM's fs tier copies host chunks to files and back."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype):
        self.shape, self.dtype = shape, dtype
        self._dir = tempfile.TemporaryDirectory(prefix="kvsim-files-")
        self.folder = Path(self._dir.name)

    def write(self, host: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        """Host block a -> file block b, for each pair."""
        for a, b in pairs:
            host[:, :, a].contiguous().numpy().tofile(self.folder / f"{b}.bin")

    def read(self, host: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        """File block a -> host block b, for each pair; a file never written reads as zeros (as fresh
        storage would: the check then finds its tokens wrong)."""
        for a, b in pairs:
            path = self.folder / f"{a}.bin"
            if not path.exists():
                host[:, :, b] = 0
                continue
            host[:, :, b] = torch.from_file(str(path), size=host[:, :, b].numel(), dtype=self.dtype).view(self.shape)
