"""Apply an op stream's data ops to the storage in batches, with the stream's order semantics.

Consecutive ops of one kind are gathered into one kernel launch (one per layer
for writes). A batch is flushed when the kind changes or when the next op
touches a block (a slot, for writes) the batch writes, or writes one it reads,
so every batch is a set of independent ops and the result equals applying the
ops one by one in stream order.
"""

from __future__ import annotations

import numpy as np
import torch

from kvsim.gpu.backends import TorchBackend, TritonBackend
from kvsim.gpu.storage import PagedKVStorage
from kvsim.gpu.timing import Timer
from kvsim.gpu.values import DeviceValues, device_keys

PAIR_KINDS = ("copy", "swap_out", "swap_in", "move", "store", "load", "file_write", "file_read")
# Fault markers in a pair op's unused `c`, set only by `gpu.faults`: what the hardware did instead.
SKIPPED = 1  # the data op did not run (block tables still change as the manager said)
ONE_WAY = 2  # a move copied b onto a instead of exchanging the two


# a one-way pair op's (source, destination) pools: "g" the device, "c" the swap pool, "h" the host
# tier of KV offloading, "f" its file tier
_POOLS = {"copy": ("g", "g"), "swap_out": ("g", "c"), "swap_in": ("c", "g"), "store": ("g", "h"),
          "load": ("h", "g"), "file_write": ("h", "f"), "file_read": ("f", "h")}
# the storage tensors (PagedKVStorage attributes) a block-to-block transfer reads and writes
_TENSORS = {"swap_out": ("gpu", "cpu"), "swap_in": ("cpu", "gpu"), "store": ("gpu", "host"), "load": ("host", "gpu")}


def _footprint(kind: str, a: int, b: int) -> tuple[set, set]:
    """(blocks read, blocks written) of one pair op, as (pool, id) (see `_POOLS`)."""
    if kind == "move":  # an exchange
        return {("g", a), ("g", b)}, {("g", a), ("g", b)}
    src, dst = _POOLS[kind]
    return {(src, a)}, {(dst, b)}


class OpExecutor:
    """Batches data ops and runs them on `storage`, timing each launch under (step, kind)."""

    def __init__(self, storage: PagedKVStorage, timer: Timer, values: DeviceValues,
                 kernels: TorchBackend | TritonBackend, swap_method: str = "kernel"):
        self.st = storage
        self.kernels = kernels
        self.values = values
        self.timer = timer
        self.swap_method = swap_method
        self.step = 0
        self.launches = 0
        self._kind: str | None = None
        self._reads: set = set()
        self._writes: set = set()
        self._pairs: list[tuple[int, int]] = []
        self._slots: list[np.ndarray] = []
        self._keys: list[np.ndarray] = []

    def write(self, slots: np.ndarray, keys: np.ndarray) -> None:
        """New K/V for `slots`, derived from the tokens' prefix `keys`."""
        new = slots.tolist()
        if self._kind != "write" or not self._writes.isdisjoint(new):
            self.flush()
            self._kind = "write"
        self._writes.update(new)
        self._slots.append(slots)
        self._keys.append(keys)

    def pair(self, kind: str, a: int, b: int) -> None:
        """A copy, swap_out, swap_in, move, store, load, file_write or file_read of (a, b)."""
        reads, writes = _footprint(kind, a, b)
        if kind != self._kind or not reads.isdisjoint(self._writes) or \
                not writes.isdisjoint(self._reads) or not writes.isdisjoint(self._writes):
            self.flush()
            self._kind = kind
        self._reads |= reads
        self._writes |= writes
        self._pairs.append((a, b))

    def flush(self) -> None:
        """Run the pending batch."""
        kind = self._kind
        if kind == "write":
            self._run_writes()
        elif kind is not None:
            self._run_pairs(kind)
        self._kind = None
        self._reads, self._writes = set(), set()
        self._pairs, self._slots, self._keys = [], [], []

    def _run_writes(self) -> None:
        st = self.st
        slots = torch.from_numpy(np.concatenate(self._slots)).to(st.device)
        vals = self.values.kv(device_keys(np.concatenate(self._keys), st.device))
        with self.timer(self.step, "write"):
            self.launches += self.timer.launched(self.step, "write", self.kernels.write(st, slots, vals))

    def _run_pairs(self, kind: str) -> None:
        st = self.st
        if kind in ("file_write", "file_read"):  # host <-> files: plain file I/O
            with self.timer(self.step, kind):
                files = st.file_blocks()
                (files.write if kind == "file_write" else files.read)(st.movable(st.host), self._pairs)
            self.launches += self.timer.launched(self.step, kind, 1)
            return
        on_host = kind in _TENSORS and self.swap_method == "torch"
        pairs = torch.tensor(self._pairs, dtype=torch.int64, device="cpu" if on_host else st.device)
        k = self.kernels
        with self.timer(self.step, kind):
            if kind == "copy":
                k.copy(st, pairs)
            elif kind in _TENSORS:
                src, dst = _TENSORS[kind]
                k.swap(st.movable(getattr(st, src)), st.movable(getattr(st, dst)), pairs, self.swap_method)
            else:
                k.exchange(st, pairs)
        self.launches += self.timer.launched(self.step, kind, 1)
