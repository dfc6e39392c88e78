"""A request's tokens as the block manager sees them, and their block keys."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from kvsim.kvcache import hashing


class Sequence:
    """Prompt, decoded tokens so far, computed tokens, and chained block keys.

    Decoded tokens come from `output` while it lasts (a known answer, e.g. a
    chat turn whose next prompt repeats it); past that they are unique, so a
    block holding any of them never matches another sequence's block.
    `uid` must be unique per sequence within a run; it seeds those unique keys
    deterministically. `keys`, if given, is what `hashing.prefix_keys` computed for this
    prompt (its full blocks' keys and the chain state after them), so it is not hashed again.
    """

    __slots__ = (
        "seq_id", "uid", "prompt", "output", "num_prompt_tokens", "num_tokens",
        "num_computed_tokens", "block_hashes", "_state", "_known", "_lineage",
    )

    def __init__(self, seq_id: str, prompt: np.ndarray, *, uid: int = 0,
                 output: np.ndarray | None = None, extra_key: int = 0,
                 keys: tuple[list[int], int] | None = None):
        self.seq_id = seq_id
        self.uid = uid
        self.prompt = prompt
        self.output = output
        self.num_prompt_tokens = len(prompt)
        self.num_tokens = len(prompt)
        self.num_computed_tokens = 0
        self.block_hashes: list[int] = [] if keys is None else keys[0]
        self._state = hashing.root_state(extra_key) if keys is None else keys[1]  # chain state after the last hashed block
        self._known = len(prompt) + (0 if output is None else len(output))
        self._lineage = ((0, uid),)  # (first position, uid) of whoever decoded unique tokens from there

    @property
    def num_known_tokens(self) -> int:
        """Prompt and known output: a block past them holds a unique decoded token, so its key
        matches no other sequence's."""
        return self._known

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    def append_tokens(self, n: int = 1) -> None:
        """Record `n` newly sampled tokens."""
        self.num_tokens += n

    def token_ids(self, start: int, end: int) -> np.ndarray:
        """Token ids at positions [start, end) as int64, past the known tokens too:
        a unique decoded token at position p is -(1 + (uid << 24 | p)), with the
        uid of the sequence that decoded it (a fork's parent, before the fork)."""
        known = min(end, self._known)
        out = np.empty(max(end - start, 0), dtype=np.int64)
        if known > start:
            out[: known - start] = self.tokens(start, known)
        _fill_unique(out, start, max(start, known), end, self._lineage)
        return out

    def token_parts(self, n: int) -> TokenIds:
        """The first `n` token ids in parts, for `TokenIds.fill` to write out later (elsewhere:
        the op log's writer): the known ids as they are stored, and the lineage of the rest."""
        return TokenIds(_as_range(self.tokens(0, min(n, self._known))), self._lineage, n)

    def tokens(self, start: int, end: int) -> np.ndarray:
        """Known token ids in [start, end) (must lie within prompt + known output)."""
        p = self.num_prompt_tokens
        if end <= p:
            return self.prompt[start:end]
        if start >= p:
            return self.output[start - p : end - p]
        return np.concatenate([self.prompt[start:], self.output[: end - p]])

    def hashes_upto(self, num_tokens: int, block_size: int) -> list[int]:
        """Keys of every full block within the first `num_tokens` tokens (cached)."""
        hashes = self.block_hashes
        n_full = num_tokens // block_size
        have = len(hashes)
        if n_full <= have:
            return hashes
        # Blocks wholly inside the known tokens: hash their content in one pass.
        n_known = min(n_full, self._known // block_size)
        if n_known > have:
            tokens = self.tokens(have * block_size, n_known * block_size)
            if n_known - have <= hashing.FEW:  # (a decode's block: the same keys in plain ints)
                keys, self._state = hashing.few_keys(self._state, tokens, block_size)
                hashes.extend(keys)
            else:
                states = hashing.chain(self._state, hashing.content_hashes(tokens, block_size))
                self._state = int(states[-1])
                hashes.extend(hashing.keys(states))
            have = n_known
        if n_full > have:  # blocks holding a unique decoded token (no known block comes after them)
            hashes.extend(hashing.unique_keys(self.uid, have, n_full))
        return hashes

    def fork(self, seq_id: str, uid: int) -> Sequence:
        """A copy sharing everything so far; its future decoded tokens are its own."""
        child = Sequence.__new__(Sequence)
        child.seq_id = seq_id
        child.uid = uid
        child.prompt = self.prompt
        child.output = self.output
        child.num_prompt_tokens = self.num_prompt_tokens
        child.num_tokens = self.num_tokens
        child.num_computed_tokens = self.num_computed_tokens
        child.block_hashes = list(self.block_hashes)
        child._state = self._state
        child._known = min(self._known, self.num_tokens)
        child._lineage = (*self._lineage, (self.num_tokens, uid))
        return child


class TokenIds(NamedTuple):
    """A sequence's first `n` token ids as `Sequence.token_parts` gives them: `known`, the known ids
    (prompt and known output) in their own dtype, or as a `range` where they run in steps of one (a
    trace's fresh prompt: a few bytes to send, not four a token), then unique decoded ids by `lineage`."""

    known: np.ndarray | range
    lineage: tuple[tuple[int, int], ...]
    n: int

    def fill(self, out: np.ndarray) -> None:
        """Write the ids into `out` (`n` long), as `Sequence.token_ids(0, n)` gives them."""
        known = self.known
        k = len(known)
        out[:k] = np.arange(known.start, known.stop, dtype=np.int64) if type(known) is range else known
        _fill_unique(out, 0, k, self.n, self.lineage)


def _as_range(ids: np.ndarray) -> np.ndarray | range:
    """`ids` as a `range` if they run first, first + 1, ... (checked whole), else as they are."""
    n = len(ids)
    if n < 2:
        return ids
    first = int(ids[0])
    if int(ids[-1]) - first != n - 1 or not np.array_equal(ids, np.arange(first, first + n, dtype=ids.dtype)):
        return ids
    return range(first, first + n)


def _fill_unique(out: np.ndarray, start: int, known: int, end: int, lineage: tuple[tuple[int, int], ...]) -> None:
    """Write the unique decoded ids of positions [known, end) into `out` (position `start` at
    index 0): -(1 + (uid << 24 | p)), each position's uid that of the lineage entry it falls in."""
    for k, (first, uid) in enumerate(lineage):
        upto = lineage[k + 1][0] if k + 1 < len(lineage) else end
        lo, hi = max(known, first), min(end, upto)
        if hi > lo:
            out[lo - start : hi - start] = -(1 + ((uid << 24) | np.arange(lo, hi, dtype=np.int64)))
