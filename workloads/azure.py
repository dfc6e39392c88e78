"""Azure LLM inference CSV traces (`TIMESTAMP`, `ContextTokens`, `GeneratedTokens`).

They carry no content, so each prompt is fresh tokens no other request has
(counted up from 0 in file order, generated lazily). Arrival is seconds since
the first row's timestamp; rows must be in time order.
"""

from __future__ import annotations

import calendar
import csv
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvsim.workloads.errors import WorkloadError, guarded, located, show, text_lines
from kvsim.workloads.request import Request, Workload, make_request
from kvsim.workloads.tokens import INT32_MAX

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


class _Clock:
    """Parses 'YYYY-MM-DD HH:MM:SS.fffffff' to seconds, caching the minute (7 fraction digits)."""

    def __init__(self) -> None:
        self.minutes: dict[str, int] = {}

    def __call__(self, text: str) -> tuple[int, float] | None:
        """(epoch seconds of the minute, seconds within it), or None if malformed."""
        head, sep, sec = text.strip().rpartition(":")
        if not sep:
            return None
        base = self.minutes.get(head)
        if base is None:
            try:
                base = calendar.timegm(time.strptime(head, "%Y-%m-%d %H:%M"))
            except ValueError:
                return None
            self.minutes[head] = base
        try:
            s = float(sec)
        except ValueError:
            return None
        return (base, s) if 0 <= s < 61 else None


class _FreshTokens:
    """A lazy prompt of fresh tokens start..start + n - 1: a few bytes a waiting request,
    where a closure costs some 300 (an overloaded trace keeps many thousands waiting)."""

    __slots__ = ("start", "n")

    def __init__(self, start: int, n: int):
        self.start, self.n = start, n

    def __call__(self) -> np.ndarray:
        return np.arange(self.start, self.start + self.n, dtype=np.int32)


def _decoded(path: str) -> Iterator[str]:
    """The file's lines as text for csv.reader; a line that is not UTF-8 raises, naming it."""
    for _, text in text_lines(path):
        if isinstance(text, WorkloadError):
            raise text
        yield text


def _next_row(reader: Any, path: str) -> list[str] | None:
    """The next row, or None at the end; a NUL byte or an unclosed quote is a WorkloadError."""
    try:
        return next(reader, None)
    except csv.Error as e:
        raise located(path, reader.line_num, f"not CSV ({e})") from None


def _rows(path: str) -> Iterator[tuple[int, list[str] | WorkloadError]]:
    reader = csv.reader(_decoded(path))
    header = _next_row(reader, path)
    if header is None:
        raise located(path, None, "empty, no header row")
    header = [h.strip() for h in header]
    missing = [c for c in COLUMNS if c not in header]
    if missing:
        raise located(path, 1, f"missing column '{missing[0]}' (header is {','.join(header)})")
    cols = [header.index(c) for c in COLUMNS]
    while (row := _next_row(reader, path)) is not None:
        line = reader.line_num
        if not any(cell.strip() for cell in row):
            continue
        if len(row) != len(header):
            yield line, located(path, line, f"expected {len(header)} columns, got {len(row)}")
            continue
        yield line, [row[i].strip() for i in cols]


def load_azure(path: str | Path, *, skip_bad: bool = False) -> Workload:
    """Stream an Azure LLM inference trace CSV as requests with unique lazy prompts."""
    path = str(path)

    def source() -> Iterator[Request]:
        clock = _Clock()
        state: dict[str, Any] = {"first": None, "next_token": 0}

        def convert(line: int, row: list[str]) -> Request:
            stamp, ctx, gen = row
            t = clock(stamp)
            if t is None:
                raise located(
                    path,
                    line,
                    f"field 'TIMESTAMP': expected 'YYYY-MM-DD HH:MM:SS.f', got {show(stamp)}",
                )
            lengths = []
            for name, cell in (("ContextTokens", ctx), ("GeneratedTokens", gen)):
                if not cell.lstrip("-").isdigit() or int(cell) < 0:
                    raise located(
                        path,
                        line,
                        f"field '{name}': expected a non-negative integer, got {show(cell)}",
                    )
                lengths.append(int(cell))
            n_prompt, n_out = lengths
            start = state["next_token"]
            if start + n_prompt > INT32_MAX + 1:
                raise located(
                    path, line, "field 'ContextTokens': unique prompt tokens overflow int32"
                )
            if state["first"] is None:
                state["first"] = t
            state["next_token"] = start + n_prompt
            first = state["first"]
            return make_request(
                str(line),
                round((t[0] - first[0]) + (t[1] - first[1]), 7),  # the file's precision
                _FreshTokens(start, n_prompt),
                n_out,
                prompt_len=n_prompt,
            )

        return guarded(wl, path, _rows(path), convert, skip_bad=skip_bad, time_field="TIMESTAMP")

    wl = Workload(source, Path(path).name)
    return wl
