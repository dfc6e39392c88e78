"""Mooncake JSONL traces: per-512-token-block prefix hash ids, made into concrete tokens.

Block `j` of a request gets tokens `hash_ids[j]*512 + [0, 512)`, truncated to
`input_length`: equal ids give equal tokens, distinct ids share no token, so
every block size that divides 512 sees exactly the sharing the trace records.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kvsim.workloads.errors import Fields, jsonl_workload, show
from kvsim.workloads.request import Request, Workload, make_request
from kvsim.workloads.tokens import max_chunk_id

MOONCAKE_BLOCK = 512


def mooncake_tokens(
    hash_ids: np.ndarray, input_length: int, block: int = MOONCAKE_BLOCK
) -> np.ndarray:
    """The prompt synthesized from a request's block hash ids (int32, length input_length)."""
    ids = np.asarray(hash_ids, dtype=np.int64)
    tokens = (ids[:, None] * block + np.arange(block, dtype=np.int64)).ravel()
    return tokens[:input_length].astype(np.int32)


def _parse(path: str, line: int, record: Any, block: int) -> Request:
    f = Fields(path, line, record)
    arrival = f.seconds("timestamp", per_second=1000)
    input_length = f.count("input_length")
    output_length = f.count("output_length")
    ids = f.get("hash_ids")
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
    ):
        raise f.error("hash_ids", f"expected a list of non-negative integers, got {show(ids)}")
    want = -(-input_length // block)
    if len(ids) != want:
        raise f.error(
            "hash_ids",
            f"expected ceil(input_length/{block}) = {want} ids, got {len(ids)}",
        )
    if ids and max(ids) > max_chunk_id(block):
        raise f.error(
            "hash_ids",
            f"id {max(ids)} too large: its tokens overflow int32 (max id {max_chunk_id(block)})",
        )
    hash_ids = np.asarray(ids, dtype=np.int64)
    return make_request(
        str(line),
        arrival,
        lambda: mooncake_tokens(hash_ids, input_length, block),
        output_length,
        prompt_len=input_length,
    )


def load_mooncake(
    path: str | Path, *, skip_bad: bool = False, block: int = MOONCAKE_BLOCK
) -> Workload:
    """Stream a Mooncake trace (`timestamp` ms, `input_length`, `output_length`, `hash_ids`).

    The file must be sorted by timestamp; an out-of-order line is a bad line.
    """
    path = str(path)
    return jsonl_workload(path, lambda line, rec: _parse(path, line, rec, block), skip_bad=skip_bad,
                          time_field="timestamp")
