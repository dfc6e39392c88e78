"""How a replay touches the storage: Triton kernels, or plain batched torch ops.

Both backends take the same calls from `gpu.executor` and `gpu.replay`, so the
op batching, block tables and checks are one code path; only the data movement
and the fused check differ. "torch" runs anywhere (the CPU verifier, and on
CUDA as a cross-check of the kernels); "triton" is what a GPU replay measures.
Triton is imported only by the triton backend: the torch one never needs it.
"""

from __future__ import annotations

import math

import torch

from kvsim.gpu.storage import PagedKVStorage

BACKENDS = ("torch", "triton")
_CHUNK = 1 << 22  # values per pass of the torch check, to bound its temporaries


class TorchBackend:
    """Every op one or two indexed torch calls over all layers at once."""

    name = "torch"
    derives_expected = False  # the replay compares against `gpu.expected.ExpectedKV`
    measures = False  # its times say nothing of a GPU: it runs only what is checked

    def write(self, st: PagedKVStorage, slots: torch.Tensor, vals: torch.Tensor) -> int:
        """vals [n, layers, 2, heads, dim] into `slots`; returns launches (kernel calls) made."""
        st.scatter(slots, vals.permute(1, 2, 0, 3, 4))
        return 1

    def copy(self, st: PagedKVStorage, pairs: torch.Tensor) -> None:
        cache = st.movable(st.gpu)
        cache.index_copy_(2, pairs[:, 1], cache.index_select(2, pairs[:, 0]))

    def swap(self, src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor, method: str) -> None:
        rows = src.index_select(2, pairs[:, 0].to(src.device))
        dst.index_copy_(2, pairs[:, 1].to(dst.device), rows.to(dst.device))

    def exchange(self, st: PagedKVStorage, pairs: torch.Tensor) -> None:
        a, b = pairs[:, 0], pairs[:, 1]
        cache = st.movable(st.gpu)
        both = cache.index_select(2, torch.cat([a, b]))
        cache.index_copy_(2, torch.cat([b, a]), both)

    def decode(self, q: torch.Tensor, st: PagedKVStorage, tables: torch.Tensor, ctx: torch.Tensor,
               window: int | None, max_context: int, layers: int) -> torch.Tensor:
        """Paged decode attention of q [B, layers, heads, D] on the first `layers` layers at once, by
        gathering each sequence's pages through `tables` [B, pages]; returns [B, layers, heads, D]."""
        b, _, hq, d = q.shape
        q = q[:, :layers]
        hkv = st.num_kv_heads
        pages = st.decode(st.gpu[:layers].index_select(2, tables.reshape(-1).long()))  # [L, 2, B * pages, bs, H, D]
        kv = pages.view(layers, 2, b, -1, hkv, d)  # [L, 2, B, span, H, D]
        pos = torch.arange(kv.shape[3], device=q.device)
        valid = pos[None, :] < ctx[:, None]
        if window:
            valid &= pos[None, :] >= (ctx[:, None] - window)
        qg = q.view(b, layers, hkv, hq // hkv, d)
        scores = torch.einsum("blkgd,lbskd->blkgs", qg, kv[:, 0]) / math.sqrt(d)
        scores = scores.masked_fill(~valid[:, None, None, None, :], float("-inf"))
        out = torch.einsum("blkgs,lbskd->blkgd", torch.softmax(scores, dim=-1), kv[:, 1])
        return out.reshape(b, layers, hq, d)

    def decode_launches(self, st: PagedKVStorage, layers: int) -> int:
        return int(layers > 0)


class TritonBackend:
    """The Triton kernels of `gpu.kernels` (on CPU only under Triton's interpreter)."""

    name = "triton"
    derives_expected = True  # `count_wrong` derives each expected value from its key in registers
    measures = True  # every kernel runs and is timed, checked or not

    def __init__(self) -> None:
        from kvsim.gpu import kernels

        self.k = kernels

    def write(self, st: PagedKVStorage, slots: torch.Tensor, vals: torch.Tensor) -> int:
        """Every layer's K/V in one launch (`write_kv_layers`), as a step's writes are one op here."""
        self.k.write_kv_layers(vals, st.gpu, slots, st.scales if st.fp8 else None)
        return 1

    def copy(self, st: PagedKVStorage, pairs: torch.Tensor) -> None:
        cache = st.movable(st.gpu)
        self.k.copy_blocks(cache, cache, pairs)

    def swap(self, src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor, method: str) -> None:
        self.k.swap_blocks(src, dst, pairs, method)

    def exchange(self, st: PagedKVStorage, pairs: torch.Tensor) -> None:
        self.k.exchange_blocks(st.movable(st.gpu), pairs)

    def any_wrong(self, planes: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, salts: torch.Tensor,
                  kv_scales: tuple[float, float] = (1.0, 1.0)) -> bool:
        return bool(self.k.count_wrong(planes, slots, keys, salts, kv_scales).any())

    def decode(self, q: torch.Tensor, st: PagedKVStorage, tables: torch.Tensor, ctx: torch.Tensor,
               window: int | None, max_context: int, layers: int) -> torch.Tensor:
        """The decode-attention kernel, one launch per layer, on every layer (each is timed)."""
        out = torch.empty_like(q)
        for layer in range(st.num_layers):
            out[:, layer] = self.k.decode_attention(q[:, layer], st.key(layer), st.value(layer), tables, ctx,
                                                    sliding_window=window, max_context=max_context,
                                                    kv_scales=st.scales)
        return out

    def decode_launches(self, st: PagedKVStorage, layers: int) -> int:
        return st.num_layers


def backend(name: str, device: torch.device) -> TorchBackend | TritonBackend:
    """The backend called `name`; triton on a CPU device needs Triton's interpreter."""
    if name == "torch":
        return TorchBackend()
    if name != "triton":
        raise ValueError(f"unknown kernels {name!r}; choose from {', '.join(BACKENDS)}")
    if device.type == "cpu":
        from kvsim.gpu.kernels.mode import interpreting

        if not interpreting():
            raise ValueError("triton kernels on device cpu need Triton's interpreter: set TRITON_INTERPRET=1 "
                             "before gpu.kernels is first imported (or use the torch kernels)")
    return TritonBackend()
