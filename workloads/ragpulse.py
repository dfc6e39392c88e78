"""RAGPulse traces: a request is a list of content chunks (system prompt, passages, ...).

Prompt = sys_prompt, passages, history, web_search, user_input chunks in that
order; a chunk's tokens come from its id and kind, its length from the
matching `N_<kind>.jsonl` file. In the published trace the chunks always sum
to 6-12 tokens fewer than `input_length` (chat-template tokens whose place is
not recorded): the gap is filled with request-unique tokens at the end, so
`prompt_len == input_length` and no sharing is invented; if the chunks are
longer than `input_length` the prompt is truncated. The file is not sorted by
time (two sorted halves), so requests are yielded stably sorted by
`timestamp` (seconds; a string in the trace).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvsim.workloads.errors import (
    Fields,
    WorkloadError,
    guarded,
    json_lines,
    located,
    not_text,
    note_skipped,
    open_bytes,
    show,
)
from kvsim.workloads.request import Request, Workload, make_request
from kvsim.workloads.tokens import CHUNK_WIDTH, INT32_MAX, chunk_tokens

TRACE_FILE = "0_trace.jsonl"
# (field in hash_ids, length file, id key) in prompt order
KINDS = (
    ("sys_prompt", "1_sys_prompt.jsonl", "sys_prompt_id"),
    ("passages_ids", "2_passages.jsonl", "passage_id"),
    ("history", "3_history.jsonl", "history_id"),
    ("web_search", "5_web_search.jsonl", "web_search_id"),
    ("user_input", "4_user_input.jsonl", "user_input_id"),
)
PAD_BASE = 2**30  # filler tokens live in [2**30, 2**31); chunk tokens below
MAX_ID = (PAD_BASE // CHUNK_WIDTH - len(KINDS)) // len(KINDS)


def _chunk_key(kind: int, chunk_id: int) -> int:
    """Chunk ids are namespaced by kind, so ids may repeat across kinds."""
    return chunk_id * len(KINDS) + kind


def load_lengths(folder: Path) -> dict[int, int]:
    """Token length of every chunk, keyed by `_chunk_key` (read from the five length files)."""
    lengths: dict[int, int] = {}
    for kind, (_, fname, key) in enumerate(KINDS):
        path = str(folder / fname)
        if not Path(path).exists():
            raise WorkloadError(f"{path}: missing RAGPulse chunk-length file")
        for line, rec in json_lines(path):
            if isinstance(rec, WorkloadError):
                raise rec
            f = Fields(path, line, rec)
            cid, n = f.count(key), f.count("token_length")
            if cid > MAX_ID:
                raise f.error(key, f"id {cid} too large (max {MAX_ID})")
            if n > CHUNK_WIDTH:
                raise f.error("token_length", f"expected at most {CHUNK_WIDTH}, got {n}")
            lengths[_chunk_key(kind, cid)] = n
    return lengths


def _index(path: str, skip_bad: bool) -> tuple[np.ndarray, list[str]]:
    """Byte offset and line of each record, stably sorted by timestamp; plus skipped errors."""
    rows: list[tuple[float, int, int]] = []
    errors: list[str] = []
    with open_bytes(path) as fh:
        offset, line = 0, 0
        for raw in fh:
            line += 1
            here, offset = offset, offset + len(raw)
            if not raw.strip():
                continue
            try:
                try:
                    rec = json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError as e:
                    raise not_text(path, line, raw, e) from None
                except json.JSONDecodeError as e:
                    raise located(path, line, f"invalid JSON: {e.msg} (column {e.colno})") from None
                t = Fields(path, line, rec).seconds("timestamp")
            except WorkloadError as e:
                if not skip_bad:
                    raise
                errors.append(str(e))
                continue
            rows.append((t, line, here))
    rows.sort(key=lambda r: r[0])  # stable: equal timestamps keep file order
    return np.array([(r[1], r[2]) for r in rows], dtype=np.int64).reshape(-1, 2), errors


def _parse(path: str, line: int, rec: Any, lengths: dict[int, int], pad: list[int]) -> Request:
    f = Fields(path, line, rec)
    arrival = f.seconds("timestamp")
    input_length = f.count("input_length")
    output_length = f.count("output_length")
    session = f.string("session_id") if f.has("session_id") else None
    groups = f.get("hash_ids")
    if not isinstance(groups, dict):
        raise f.error("hash_ids", f"expected an object of chunk-id lists, got {show(groups)}")
    keys: list[int] = []
    for kind, (name, _, _) in enumerate(KINDS):
        ids = groups.get(name, [])
        if not isinstance(ids, list):
            raise f.error("hash_ids", f"'{name}': expected a list of chunk ids, got {show(ids)}")
        for cid in ids:
            k = (
                _chunk_key(kind, cid)
                if isinstance(cid, int) and not isinstance(cid, bool)
                else None
            )
            if k is None or k not in lengths:
                raise f.error("hash_ids", f"'{name}': unknown chunk id {show(cid)}")
            keys.append(k)
    sizes = np.array([lengths[k] for k in keys], dtype=np.int64)
    n_pad = max(0, input_length - int(sizes.sum()))
    start = pad[0]
    if start + n_pad > INT32_MAX + 1:
        raise f.error("input_length", "filler tokens overflow int32")
    pad[0] += n_pad
    chunk_ids = np.array(keys, dtype=np.int64)

    def prompt() -> np.ndarray:
        body = chunk_tokens(chunk_ids, sizes)[:input_length]
        return np.concatenate([body, np.arange(start, start + n_pad, dtype=np.int32)])

    return make_request(
        str(line), arrival, prompt, output_length, prompt_len=input_length, session=session
    )


def load_ragpulse(path: str | Path, *, skip_bad: bool = False) -> Workload:
    """Stream a RAGPulse trace, given its folder or its `0_trace.jsonl`, sorted by time."""
    p = Path(path)
    trace = p / TRACE_FILE if p.is_dir() else p
    if p.is_dir() and not trace.exists():
        raise WorkloadError(f"{p}: a folder but not a RAGPulse trace (no {TRACE_FILE} in it)")
    if not trace.exists():
        raise WorkloadError(f"{trace}: no such file")
    lengths = load_lengths(trace.parent)
    tpath = str(trace)
    cache: dict[str, Any] = {}

    def records() -> Iterator[tuple[int, Any]]:
        if "index" not in cache:
            cache["index"] = _index(tpath, skip_bad)
        index, errors = cache["index"]
        for e in errors:
            note_skipped(wl, WorkloadError(e))
        with open(tpath, "rb") as fh:
            for line, offset in index.tolist():
                fh.seek(offset)
                yield line, json.loads(fh.readline())

    def source() -> Iterator[Request]:
        pad = [PAD_BASE]
        return guarded(
            wl,
            tpath,
            records(),
            lambda line, rec: _parse(tpath, line, rec, lengths, pad),
            skip_bad=skip_bad,
            time_field=None,
        )

    wl = Workload(source, trace.parent.name)
    return wl
