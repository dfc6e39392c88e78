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

An FP8 cache (vLLM's `--kv-cache-dtype fp8`, e4m3, or fp8_e5m2) holds each value divided by its
plane's scale (vLLM's per-layer `k_scale` and `v_scale`, 1.0 unless a checkpoint gives them) in one
byte; it is read back as value x scale (`encode`, `decode`). Values are made and compared in
`compute_dtype` (float16 for FP8). A replay's values are quarters in [-1, 0.75] (`gpu.values`), which
e4m3 and e5m2 hold exactly after division by a power of two, so an FP8 replay checks bit for bit
as a 16-bit one does; the scales must be powers of two. Block moves handle the FP8 planes as bytes
(`movable`: torch has no CPU index_copy_ for them).
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)  # vLLM's fp8 (e4m3) and fp8_e5m2 KV caches
SCALE_RANGE = (2.0 ** -8, 2.0 ** 6)  # powers of two whose quotients of [-1, 0.75] both FP8 formats hold exactly


def check_scales(scales: tuple[float, float], fp8: bool) -> tuple[float, float]:
    """The (K, V) scales, checked: 1.0 unless the cache is FP8, else powers of two in SCALE_RANGE."""
    if len(scales) != 2:
        raise ValueError(f"kv scales: one for K and one for V, got {scales!r}")
    k, v = (float(x) for x in scales)
    if not fp8:
        if (k, v) != (1.0, 1.0):
            raise ValueError(f"kv scales {k:g}, {v:g}: only an FP8 cache is scaled")
        return k, v
    lo, hi = SCALE_RANGE
    for name, x in (("K", k), ("V", v)):
        if not (lo <= x <= hi and math.frexp(x)[0] == 0.5):
            raise ValueError(f"{name} scale {x:g}: a power of two from 2^-8 to 2^6 (so the replay's values "
                             "stay exact in FP8)")
    return k, v


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
        scales: tuple[float, float] = (1.0, 1.0),
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
        self.fp8 = dtype in FP8_DTYPES
        self.scales = check_scales(scales, self.fp8)
        self.compute_dtype = torch.float16 if self.fp8 else dtype  # what values are made and compared in
        self.device = torch.device(device)
        self._scale = torch.tensor(self.scales, dtype=self.compute_dtype, device=self.device).view(1, 2, 1, 1, 1)
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
            self._files = FileBlocks(self.host.shape[:2] + self.host.shape[3:], torch.uint8 if self.fp8 else self.dtype)
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

    def encode(self, planes: torch.Tensor) -> torch.Tensor:
        """Values [layers, 2, ...] in `compute_dtype` as the cache holds them (FP8: over each plane's scale)."""
        if not self.fp8:
            return planes.to(self.dtype)
        scale = self._scale.view(1, 2, *([1] * (planes.dim() - 2)))
        return (planes.to(self.compute_dtype) / scale).to(self.dtype)

    def decode(self, planes: torch.Tensor) -> torch.Tensor:
        """Cached values [layers, 2, ...] as the values they stand for, in `compute_dtype`."""
        if not self.fp8:
            return planes
        return planes.to(self.compute_dtype) * self._scale.view(1, 2, *([1] * (planes.dim() - 2)))

    def movable(self, t: torch.Tensor) -> torch.Tensor:
        """`t` as block moves index it: an FP8 tensor as its bytes, any other as it is."""
        return t.view(torch.uint8) if self.fp8 else t

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """The values at `slots` of every plane, decoded: [num_layers, 2, len(slots), heads, dim]."""
        return self.decode(self.slots().index_select(2, slots))

    def scatter(self, slots: torch.Tensor, planes: torch.Tensor) -> None:
        """Values [num_layers, 2, len(slots), heads, dim] (`compute_dtype`) into `slots` of every plane."""
        self.movable(self.slots()).index_copy_(2, slots, self.movable(self.encode(planes)))


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
