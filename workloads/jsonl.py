"""kvsim's own JSON Lines format: one request per line, tokens spelled out.

    {"id": "r0", "arrival": 0.5, "prompt": [1, 2, 3], "output_len": 4,
     "output": [7, 8, 9, 10], "session": "s0", "n": 1, "priority": 0, "think_time": 2.0}

`id`, `arrival` (seconds), `prompt` (token ids, each in [0, 2**31)) and
`output_len` are required; the rest are optional (`output`, when given, has
exactly `output_len` tokens). Lines must be sorted by `arrival`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from kvsim.workloads.errors import Fields, jsonl_workload, show
from kvsim.workloads.request import Request, Workload, make_request
from kvsim.workloads.tokens import INT32_MAX


def _tokens(f: Fields, name: str) -> np.ndarray:
    v = f.get(name)
    arr = np.asarray(v) if isinstance(v, list) else None
    if (
        arr is None
        or arr.ndim != 1
        or (arr.size and (arr.dtype.kind not in "iu" or arr.min() < 0 or arr.max() > INT32_MAX))
    ):
        raise f.error(name, f"expected a list of token ids in [0, 2**31), got {show(v)}")
    return arr.astype(np.int32)


def parse_record(path: str, line: int, record: Any) -> Request:
    """One kvsim JSONL record as a Request (raises WorkloadError naming the field)."""
    f = Fields(path, line, record)
    rid = f.string("id")
    arrival = f.seconds("arrival")
    prompt = _tokens(f, "prompt")
    output_len = f.count("output_len")
    output = _tokens(f, "output") if f.has("output") else None
    if output is not None and len(output) != output_len:
        raise f.error("output", f"has {len(output)} tokens but output_len is {output_len}")
    n = f.count("n") if f.has("n") else 1
    if n < 1:
        raise f.error("n", f"expected a positive integer, got {n}")
    priority = 0
    if f.has("priority"):
        priority = f.get("priority")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise f.error("priority", f"expected an integer, got {show(priority)}")
    return make_request(
        rid,
        arrival,
        prompt,
        output_len,
        output=output,
        session=f.string("session") if f.has("session") else None,
        n=n,
        priority=priority,
        think_time=f.seconds("think_time") if f.has("think_time") else None,
    )


def load_jsonl(path: str | Path, *, skip_bad: bool = False) -> Workload:
    """Stream a kvsim JSONL workload (must be sorted by `arrival`)."""
    path = str(path)
    return jsonl_workload(path, lambda line, rec: parse_record(path, line, rec), skip_bad=skip_bad,
                          time_field="arrival", unique_ids=True)


def request_record(r: Request) -> dict[str, Any]:
    """The JSON object for one request; optional fields only when not at their default."""
    rec: dict[str, Any] = {
        "id": r.id,
        "arrival": r.arrival,
        "prompt": r.prompt.tolist(),
        "output_len": r.output_len,
    }
    if r.output is not None:
        rec["output"] = r.output.tolist()
    if r.session is not None:
        rec["session"] = r.session
    if r.n != 1:
        rec["n"] = r.n
    if r.priority != 0:
        rec["priority"] = r.priority
    if r.think_time is not None:
        rec["think_time"] = r.think_time
    return rec


def write_jsonl(requests: Iterable[Request], path: str | Path) -> int:
    """Write requests as kvsim JSONL, one per line, streaming; returns how many."""
    count = 0
    with open(path, "w", encoding="utf-8") as fh:
        for r in requests:
            fh.write(json.dumps(request_record(r), separators=(",", ":")) + "\n")
            count += 1
    return count
