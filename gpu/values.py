"""What every cached token should hold: K, V and a query, functions of the token's prefix.

    key[p]  = mix(H_p),  H_p = H_{p-1} * P + content(tokens[p])      (kvcache.hashing's chain, per token)
    K/V/q   = (top 3 bits of key[p] * salt[layer, kv, head, dim] - 4) / 4,  in {-1, -0.75, ..., 0.75}

Two sequences sharing a prefix share K/V (as in a real model), so prefix hits
and forks verify, while data from any other prefix differs in almost every
element; each KV-cache group's keys are the prefix keys mixed with the group
(`group_keys`: a hybrid model's groups are different layers). A Mamba group's
state page after p tokens is one value, that of key p - 1, in every slot. Quarters are exact in fp16, bf16 and fp32, so checks are bit-exact.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from kvsim.kvcache import hashing
from kvsim.kvcache.groups import group_salt

_U64 = np.uint64
_CHUNK = 1 << 22  # elements per vectorised pass, to bound temporaries


def _mix(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser (as in kvcache.hashing), vectorised, wrapping mod 2^64."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> _U64(30))
        x = x * _U64(0xBF58476D1CE4E5B9)
        x = x ^ (x >> _U64(27))
        x = x * _U64(0x94D049BB133111EB)
        return x ^ (x >> _U64(31))


def prefix_keys(tokens: np.ndarray) -> np.ndarray:
    """uint64 key of every position p: equal iff tokens[0..p] are equal (up to hash collisions)."""
    tokens = np.asarray(tokens, dtype=np.int64)
    if tokens.size == 0:
        return np.zeros(0, dtype=np.uint64)
    contents = hashing.content_hashes(tokens, 1)
    return _mix(hashing.chain(hashing.root_state(), contents))


def group_keys(keys: np.ndarray, group: int) -> np.ndarray:
    """`keys` as KV-cache group `group` holds them: group 0's are the keys themselves (a one-group
    stream verifies as before), another group's are mixed with its salt (`kvcache.groups.group_salt`),
    so a block read through the wrong group's table, or left stale after another group took it,
    holds values no key of this group gives."""
    if group == 0:
        return keys
    return _mix(np.asarray(keys, dtype=np.uint64) ^ _U64(group_salt(group)))


@lru_cache(maxsize=16)
def _salts(n: int, stream: int) -> np.ndarray:
    rng = np.random.default_rng([0x6B76, stream])
    return rng.integers(0, 1 << 63, size=n, dtype=np.uint64) << _U64(1) | _U64(1)


def _quarters(keys: np.ndarray, shape: tuple[int, ...], stream: int) -> np.ndarray:
    n, width = len(keys), int(np.prod(shape))
    salts = _salts(width, stream)
    out = np.empty((n, width), dtype=np.float32)
    step = max(1, _CHUNK // width)
    with np.errstate(over="ignore"):
        for i in range(0, n, step):
            top = (keys[i : i + step, None] * salts[None, :]) >> _U64(61)
            out[i : i + step] = (top.astype(np.float32) - 4.0) * 0.25
    return out.reshape((n, *shape))


def kv_values(keys: np.ndarray, num_layers: int, num_kv_heads: int, head_dim: int) -> np.ndarray:
    """Expected K and V for positions with prefix `keys`: float32 [n, layers, 2, kv heads, head_dim]."""
    return _quarters(np.asarray(keys, dtype=np.uint64), (num_layers, 2, num_kv_heads, head_dim), 0)


def query_values(keys: np.ndarray, num_layers: int, num_heads: int, head_dim: int) -> np.ndarray:
    """The query a decode step at each of those positions asks: float32 [n, layers, heads, head_dim]."""
    return _quarters(np.asarray(keys, dtype=np.uint64), (num_layers, num_heads, head_dim), 1)


class DeviceValues:
    """`kv_values` and `query_values` computed on the storage's device, bit-equal to the numpy
    versions: the replay writes and checks millions of tokens, so values never cross PCIe.

    uint64 arithmetic is done in int64 (multiplication wraps mod 2^64 alike); the top 3
    bits are `(x >> 61) & 7`, which an arithmetic shift gives too.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, num_heads: int, head_dim: int,
                 device: torch.device, dtype: torch.dtype):
        self.kv_shape = (num_layers, 2, num_kv_heads, head_dim)
        self.q_shape = (num_layers, num_heads, head_dim)
        self.dtype = dtype
        self._kv = self._salts(self.kv_shape, 0, device)
        self._q = self._salts(self.q_shape, 1, device)

    @staticmethod
    def _salts(shape: tuple[int, ...], stream: int, device: torch.device) -> torch.Tensor:
        s = _salts(int(np.prod(shape)), stream).view(np.int64)
        return torch.from_numpy(s.copy()).to(device).view(shape)

    @property
    def kv_salts(self) -> torch.Tensor:
        """The K/V salts as [layers * 2 planes, kv heads * dim]: `gpu.kernels.count_wrong`'s layout."""
        return self._kv.view(self.kv_shape[0] * 2, -1)

    def _quarters(self, keys: torch.Tensor, salts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        flat = salts.reshape(-1)
        out = torch.empty((len(keys), flat.numel()), dtype=dtype, device=flat.device)
        step = max(1, _CHUNK // flat.numel())
        for i in range(0, len(keys), step):
            top = ((keys[i : i + step, None] * flat[None, :]) >> 61) & 7
            out[i : i + step] = (top - 4).to(dtype) * 0.25
        return out.view(len(keys), *salts.shape)

    def kv(self, keys: torch.Tensor, layer: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """K/V of int64 prefix `keys`: [n, layers, 2, kv heads, dim], or [n, 2, kv heads, dim] of one layer."""
        salts = self._kv if layer is None else self._kv[layer]
        return self._quarters(keys, salts, dtype or self.dtype)

    def query(self, keys: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Decode queries of int64 prefix `keys`: [n, layers, heads, dim]."""
        return self._quarters(keys, self._q, dtype or self.dtype)


def device_keys(keys: np.ndarray, device: torch.device) -> torch.Tensor:
    """uint64 prefix keys as an int64 tensor on `device` (same bits)."""
    return torch.from_numpy(np.ascontiguousarray(keys, dtype=np.uint64).view(np.int64)).to(device)
