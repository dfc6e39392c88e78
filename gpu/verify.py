"""Exact integrity checks: a sequence's cached K/V against its prefix's values, decode output against dense attention."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from kvsim.gpu.storage import PagedKVStorage

# Decode outputs are convex combinations of values in [-1, 0.75]: absolute tolerance per dtype.
ATTENTION_ATOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 4e-2}


class IntegrityError(Exception):
    """A cached token (or a decode output) is not what its prefix implies; the message says where."""


@dataclass(frozen=True)
class Mismatch:
    """The first wrong value found for one sequence in one step."""

    step: int
    seq: str
    position: int
    what: str  # "K", "V", "attention" or "table"
    layer: int = -1
    head: int = -1
    entry: int = -1
    block: int = -1
    expected: tuple = ()
    found: tuple = ()
    error: float = 0.0
    atol: float = 0.0
    blocks: tuple[int, ...] = ()  # every physical block holding a wrong position in this check

    def message(self) -> str:
        at = f"step {self.step}, sequence {self.seq!r}: "
        if self.what == "table":
            return at + f"position {self.position} has no block-table entry {self.entry}"
        if self.what == "attention":
            return at + (f"decode attention at position {self.position}, layer {self.layer}, head {self.head} "
                         f"differs from dense attention by {self.error:.3g} (tolerance {self.atol:g})")
        return at + (f"position {self.position} (block-table entry {self.entry}, physical block {self.block}), "
                     f"layer {self.layer} {self.what} head {self.head}: expected {list(self.expected)}, "
                     f"found {list(self.found)}")


def compare_kv(storage: PagedKVStorage, positions: np.ndarray, blocks: np.ndarray, expected: torch.Tensor,
               *, step: int, seq: str) -> tuple[int, Mismatch | None]:
    """Cached K/V of `positions` (in physical `blocks`) against `expected` [n, layers, 2, heads, dim];
    returns the number of wrong positions and the first of them."""
    bs = storage.block_size
    slots = torch.from_numpy(blocks * bs + positions % bs).to(storage.device)
    got = storage.gather(slots).permute(2, 0, 1, 3, 4)
    wrong = got != expected
    bad = wrong.flatten(1).any(1)
    n_bad = int(bad.sum())
    if not n_bad:
        return 0, None
    rows = bad.nonzero()[:, 0].cpu().numpy()
    i = int(rows[0])
    layer, kv, head = (int(x) for x in wrong[i].nonzero()[0, :3])
    show = slice(0, 4)
    return n_bad, Mismatch(
        step, seq, int(positions[i]), "KV"[kv], layer, head, int(positions[i]) // bs, int(blocks[i]),
        tuple(expected[i, layer, kv, head, show].tolist()), tuple(got[i, layer, kv, head, show].tolist()),
        blocks=tuple(int(x) for x in np.unique(blocks[rows])),
    )


def dense_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Reference decode attention, batched: q [B, heads, D] over k/v [B, S, kv heads, D] where
    `valid` [B, S]; in q's dtype (pick float32 or float64), explicit softmax. Returns [B, heads, D]."""
    b, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.view(b, hkv, hq // hkv, d)
    scores = torch.einsum("bkgd,bskd->bkgs", qg, k) / math.sqrt(d)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    return torch.einsum("bkgs,bskd->bkgd", torch.softmax(scores, dim=-1), v).reshape(b, hq, d)


def attention_errors(out: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """Largest absolute error per (sequence, head) of a decode output against the reference."""
    return (out.to(dense.dtype) - dense).abs().amax(-1)


def first_bad(errors: torch.Tensor, dtype: torch.dtype, *, step: int, seqs: list[str],
              positions: list[int]) -> tuple[int, Mismatch] | None:
    """errors [layers, B, heads] against the dtype's tolerance: None if all within it (one device
    sync), else the number of wrong (layer, sequence, head) rows and the first of them."""
    atol = ATTENTION_ATOL[dtype]
    bad = errors > atol
    if not bool(bad.any()):
        return None
    layer, b, head = (int(x) for x in bad.nonzero()[0])
    return int(bad.sum()), Mismatch(step, seqs[b], positions[b], "attention", layer, head,
                                    error=float(errors[layer, b, head]), atol=atol)
