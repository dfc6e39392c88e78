"""Each live sequence's expected K/V, derived once per position rather than once per check.

A replay reads a decoding sequence's whole context back every step, so the same
positions are checked thousands of times; their values (`gpu.values`) depend
only on the prefix, so they are derived when a position is first needed and
kept, in the storage's dtype, until the sequence is freed.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from kvsim.gpu.values import DeviceValues, device_keys


class ExpectedKV:
    """Per live sequence, its expected K/V in the storage's slot layout: [layers, 2, tokens, kv heads, dim]
    (so a check compares against `PagedKVStorage.slots()` gathered, both contiguous)."""

    def __init__(self, values: DeviceValues, keys: Callable[[str], np.ndarray], device: torch.device):
        self.values, self.keys, self.device = values, keys, device
        self._kv: dict[str, torch.Tensor] = {}

    def upto(self, seq: str, n: int) -> torch.Tensor:
        """Expected K/V of positions [0, n) of `seq`: [layers, 2, n, kv heads, dim] (a view).
        The whole sequence is derived on first use, in one pass: its tokens are all known."""
        kv = self._kv.get(seq)
        if kv is None:
            kv = self.values.kv(device_keys(self.keys(seq), self.device)).permute(1, 2, 0, 3, 4).contiguous()
            self._kv[seq] = kv
        return kv[:, :, :n]

    def at(self, seq: str, positions: np.ndarray, extent: int) -> torch.Tensor:
        """Expected K/V of `positions` (sorted, all below `extent`) of `seq`."""
        kv = self.upto(seq, extent)
        if len(positions) == extent:
            return kv
        return kv.index_select(2, torch.from_numpy(positions).to(self.device))

    def drop(self, seq: str) -> None:
        """Forget `seq` (its blocks were freed)."""
        self._kv.pop(seq, None)
