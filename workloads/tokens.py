"""Token-id spaces: prompt tokens that are equal exactly when their content is shared.

Every prompt token id is >= 0 and fits int32; negative ids are reserved for
the unique tokens the simulator decodes when a request's answer is unknown.
"""

from __future__ import annotations

import numpy as np

INT32_MAX = 2**31 - 1
CHUNK_WIDTH = 512  # tokens reserved per content chunk (Mooncake's block size)


def max_chunk_id(width: int = CHUNK_WIDTH) -> int:
    """Largest chunk id whose tokens `id*width .. id*width+width-1` still fit int32."""
    return (INT32_MAX + 1) // width - 1


def chunk_tokens(ids: np.ndarray, lengths: np.ndarray, width: int = CHUNK_WIDTH) -> np.ndarray:
    """Concatenated tokens of content chunks: chunk `c` of length `l` is `c*width + [0, l)`.

    Equal ids give equal tokens; distinct ids never share a token, so no block
    of any size can match across chunks by accident. Ids must be <= max_chunk_id.
    """
    ids = np.asarray(ids, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    starts = np.cumsum(lengths) - lengths
    base = np.repeat(ids * width - starts, lengths)
    return (base + np.arange(total, dtype=np.int64)).astype(np.int32)


class TokenCounter:
    """Hands out fresh token ids from [start, stop): content no other text shares."""

    def __init__(self, start: int = 0, stop: int = INT32_MAX + 1):
        if not 0 <= start <= stop <= INT32_MAX + 1:
            raise ValueError(f"token range [{start}, {stop}) must lie within [0, 2**31)")
        self.next = start
        self.stop = stop

    def take(self, n: int) -> np.ndarray:
        """`n` new int32 token ids, never handed out before by this counter."""
        if self.next + n > self.stop:
            raise ValueError(
                f"token ids exhausted: need {n} more from {self.next}, range ends at {self.stop}"
            )
        out = np.arange(self.next, self.next + n, dtype=np.int32)
        self.next += n
        return out
