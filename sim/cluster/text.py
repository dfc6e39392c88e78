"""The prompt text kvsim's text-hashing routers see: each token id as four fixed characters.

Routers such as llm-d's approximate prefix scorer and SGLang's cache-aware policy never tokenize;
they hash or match the request's characters. kvsim's requests carry token ids, so a router reads
the prompt as text made by one fixed rule: token id t (0 <= t < 2**32) becomes the four characters
whose code points are t's four bytes, big-endian (chr(0)..chr(255)). Equal token prefixes give
equal text prefixes, distinct ids give distinct text, and the text is `4 x prompt_len` characters,
also 4 x prompt_len bytes as latin-1: llm-d's own average of 4 characters a token
(approximateprefix/types.go `averageCharactersPerToken`) made exact, so its 16-token x 4-character
blocks cover exactly the engine's 16-token blocks. Real text varies in characters a token; this
mapping is the idealised case, and deterministic.
"""

from __future__ import annotations

import numpy as np

from kvsim.workloads.request import Request

CHARS_PER_TOKEN = 4


def token_bytes(tokens: np.ndarray) -> bytes:
    """Four bytes a token, big-endian: the prompt's text as llm-d hashes it (a byte a character)."""
    ids = np.asarray(tokens, dtype=np.int64)
    if len(ids) and (ids.min() < 0 or ids.max() >= 2**32):
        raise ValueError(f"token ids must lie in [0, 2**32) to be rendered as text, got {int(ids.min())}..{int(ids.max())}")
    return ids.astype(">u4").tobytes()


def token_text(tokens: np.ndarray) -> str:
    """The text of `tokens`: four characters (code points 0-255) a token."""
    return token_bytes(tokens).decode("latin-1")


def prompt_bytes(request: Request) -> bytes:
    """`request`'s prompt as bytes, four a token (`token_bytes`)."""
    return token_bytes(request.prompt)


def prompt_text(request: Request) -> str:
    """`request`'s prompt as text, four characters a token (`token_text`)."""
    return token_text(request.prompt)
