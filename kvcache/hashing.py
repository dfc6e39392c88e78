"""Chained block hashes: a full block's cache key depends on every token before it.

Semantically this is vLLM's `hash(parent_hash, block_tokens, extra_keys)`: two
blocks get the same key iff their whole prefixes (and extra keys) are equal.
It is computed for all blocks of a sequence at once with numpy:

    c_i = mix(sum_t (tok[i, t] + 1) * R[t])          content of block i
    H_i = H_{i-1} * P + c_i   (mod 2^64)             the chain, a linear recurrence
    key_i = mix(H_i)

The recurrence is solved in closed form with a cumulative sum, so hashing a
10k-token prompt is a handful of vector operations. A block holding a unique
decoded token (past its sequence's known tokens) matches nothing, so its key is
just distinct (`unique_keys`). Keys are stable across runs and machines (no
salted `hash()`).
"""

from __future__ import annotations

import numpy as np

_U64 = np.uint64
_P = 0x9E3779B97F4A7C15  # odd, so invertible mod 2^64
_P_INV = pow(_P, -1, 1 << 64)
_MASK = (1 << 64) - 1
_CHUNK = 4096

with np.errstate(over="ignore"):
    _R = (np.random.default_rng(0x6B7673696D).integers(0, 1 << 63, size=4096, dtype=np.uint64) << _U64(1)) | _U64(1)


_S30, _S27, _S31 = _U64(30), _U64(27), _U64(31)
_M1, _M2 = _U64(0xBF58476D1CE4E5B9), _U64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser, vectorised (wraps mod 2^64); `x` is left as it is.

    In place on one new array and one scratch (a prompt's blocks are few, so each numpy call's
    fixed cost, not the arithmetic, is what a prompt pays)."""
    y = x >> _S30
    y ^= x
    y *= _M1
    t = y >> _S27
    y ^= t
    y *= _M2
    np.right_shift(y, _S31, out=t)
    y ^= t
    return y


def _mix_int(x: int) -> int:
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _MASK
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


class _Powers:
    """Cached P^k and P^-k mod 2^64, grown on demand."""

    def __init__(self) -> None:
        self.fwd = np.ones(1, dtype=np.uint64)
        self.inv = np.ones(1, dtype=np.uint64)

    def upto(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        if len(self.fwd) < n:
            size = max(n, 2 * len(self.fwd), _CHUNK)
            self.fwd, self.inv = _powers(_P, size), _powers(_P_INV, size)
        return self.fwd, self.inv


def _powers(x: int, size: int) -> np.ndarray:
    """x^0 .. x^(size-1) mod 2^64 (uint64 products wrap)."""
    out = np.full(size, x, dtype=np.uint64)
    out[0] = 1
    return np.multiply.accumulate(out, out=out)


_POW = _Powers()
_R_SUMS: dict[int, np.uint64] = {}  # block size -> sum of its R[t] (mod 2^64)


def _r_sum(block_size: int) -> np.uint64:
    """The sum of R[0..block_size-1] (mod 2^64), kept per block size: both content hashes add it."""
    r_sum = _R_SUMS.get(block_size)
    if r_sum is None:
        r_sum = _R_SUMS[block_size] = _R[:block_size].sum(dtype=np.uint64)
    return r_sum


def content_hashes(tokens: np.ndarray, block_size: int) -> np.ndarray:
    """Content hash of each full block of `tokens` (uint64, one per block)."""
    nb = len(tokens) // block_size
    if block_size > len(_R):
        raise ValueError(f"block size {block_size} exceeds the hasher's limit {len(_R)}")
    t = tokens[: nb * block_size].astype(np.uint64, copy=False).reshape(nb, block_size)
    r = _R[:block_size]
    r_sum = _r_sum(block_size)
    # sum_t (tok + 1) * R[t] as a product plus sum_t R[t] (mod 2^64), without block-sized temporaries;
    # NOTE: uint64 array arithmetic wraps silently (only numpy scalars warn), so no errstate here
    c = t @ r
    c += r_sum
    return _mix(c)


def chain(state: int, contents: np.ndarray) -> np.ndarray:
    """Raw chain states H_i for `contents` continuing from chain state `state`.

    H_i = state * P^(i+1) + sum_{j<=i} c_j * P^(i-j) = P^(i+1) * (state + sum_j c_j * P^-(j+1)).
    """
    n = len(contents)
    fwd, inv = _POW.upto(n + 1)
    acc = np.cumsum(contents * inv[1 : n + 1], dtype=np.uint64)
    return (acc + _U64(state)) * fwd[1 : n + 1]


_R_INTS = _R.tolist()  # R[t] as Python ints, for `few_keys`
FEW = 2  # at most this many blocks go through `few_keys` (`Sequence.hashes_upto`)


def few_keys(state: int, tokens: np.ndarray, block_size: int) -> tuple[list[int], int]:
    """Keys of the full blocks of `tokens` continuing from raw chain state `state`, and the raw state
    after the last: `keys(chain(state, content_hashes(tokens, block_size)))` in plain Python ints.
    For a block or two (a decode filling a block of known tokens, one at a time) the vector path's
    dozen numpy calls cost several times the arithmetic; the values are the same (mod 2^64)."""
    if block_size > len(_R_INTS):
        raise ValueError(f"block size {block_size} exceeds the hasher's limit {len(_R_INTS)}")
    toks = tokens.tolist()
    r = _R_INTS[:block_size]
    r_sum = int(_r_sum(block_size))
    out = []
    for i in range(len(toks) // block_size):
        c = _mix_int((sum(map(int.__mul__, toks[i * block_size:(i + 1) * block_size], r)) + r_sum) & _MASK)
        state = (state * _P + c) & _MASK
        out.append(_mix_int(state))
    return out, state


def keys(states: np.ndarray) -> list[int]:
    """Cache keys (Python ints) for raw chain states."""
    return _mix(states).tolist()


def prefix_keys(prompts: list[np.ndarray], block_size: int, extra_key: int = 0) -> list[tuple[list[int], int]]:
    """For each prompt, the keys of its full blocks and the raw chain state after them: what
    hashing each prompt alone gives, in one pass over all of them.

    Each chain restarts at its prompt's first block s: H_g = P^(g-s+1) * (root + P^s * (G_g - G_(s-1)))
    with G the running sum of c_j * P^-(j+1) over every block of the batch (mod 2^64).
    """
    root = root_state(extra_key)
    if len(prompts) == 1:
        # NOTE: one prompt (a lightly loaded engine's WAITING holds only the request arriving) is the
        # plain chain: half the vector operations of the batched form, the same keys
        p = prompts[0]
        if len(p) < block_size:
            return [([], root)]
        states = chain(root, content_hashes(p, block_size))
        return [(keys(states), int(states[-1]))]
    counts = [len(p) // block_size for p in prompts]
    total = sum(counts)
    if not total:
        return [([], root) for _ in prompts]
    tokens = np.concatenate([p[: n * block_size] for p, n in zip(prompts, counts, strict=True)],
                            dtype=np.uint64, casting="unsafe")  # int64 to uint64 keeps the bits, as astype does
    contents = content_hashes(tokens, block_size)
    fwd, inv = _POW.upto(total + 1)
    g = np.zeros(total + 1, dtype=np.uint64)  # g[j + 1] = G_j
    np.cumsum(contents * inv[1 : total + 1], dtype=np.uint64, out=g[1:])
    ends = np.cumsum(counts)
    starts = np.repeat(ends - counts, counts)  # each block's prompt's first block
    states = fwd[np.arange(1, total + 1) - starts] * (fwd[starts] * (g[1:] - g[starts]) + _U64(root))
    flat, ends = keys(states), ends.tolist()
    raw = states[[e - 1 for n, e in zip(counts, ends, strict=True) if n]].tolist()[::-1]  # last states, popped in order
    return [(flat[e - n : e], raw.pop() if n else root) for n, e in zip(counts, ends, strict=True)]


_ODD = 0xD1342543DE82EF95  # x -> x * _ODD is a bijection mod 2^64


def unique_keys(uid: int, start: int, end: int) -> list[int]:
    """Keys of blocks start..end-1 of the sequence `uid` that hold a unique decoded token. No
    other sequence's block holds that token, so these keys need only be distinct, not a hash
    of the prefix: an odd multiply and an xorshift (both invertible) spread (uid, i) over 64 bits."""
    base = uid << 32
    out = []
    for i in range(start, end):
        y = ((base | i) * _ODD) & _MASK
        out.append(y ^ (y >> 29))
    return out


def root_state(extra_key: int = 0) -> int:
    """Chain state before the first block; `extra_key` (e.g. LoRA id or cache
    salt) separates otherwise equal prefixes."""
    return _mix_int((extra_key * 0xD6E8FEB86659FD93 + 0x1234567) & _MASK)


def block_keys(tokens: np.ndarray, block_size: int, extra_key: int = 0) -> list[int]:
    """Cache keys of every full block of `tokens` (a convenience for tests and tools)."""
    return keys(chain(root_state(extra_key), content_hashes(np.asarray(tokens), block_size)))
