"""What every cached token should hold: K, V and a query, functions of the token's prefix.

    key[p]  = mix(H_p),  H_p = H_{p-1} * P + content(tokens[p])      (kvcache.hashing's chain, per token)
    K/V/q   = (top 3 bits of key[p] * salt[layer, kv, head, dim] - 4) / 4,  in {-1, -0.75, ..., 0.75}

Two sequences sharing a prefix share K/V (as in a real model), so prefix hits
and forks verify, while data from any other prefix differs in almost every
element. Quarters are exact in fp16, bf16 and fp32, so checks are bit-exact.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from kvcache import hashing

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
