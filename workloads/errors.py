"""WorkloadError and the field checks every loader shares, so messages read the same."""

from __future__ import annotations

import io
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from kvsim.workloads.request import Request, Workload

MAX_KEPT_ERRORS = 10


class WorkloadError(ValueError):
    """A bad workload input; the message names the file, line and field."""


def located(path: str, line: int | None, msg: str) -> WorkloadError:
    """`WorkloadError("path:line: msg")` (no line part when `line` is None)."""
    where = f"{path}:{line}" if line is not None else str(path)
    return WorkloadError(f"{where}: {msg}")


def show(value: Any) -> str:
    """A short JSON-ish rendering of a bad value for error messages."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class Fields:
    """Typed access to one record's fields; each failure names path, line and field."""

    def __init__(self, path: str, line: int, record: Any):
        self.path, self.line = path, line
        if not isinstance(record, dict):
            raise located(path, line, f"expected a JSON object, got {show(record)}")
        self.record = record

    def error(self, name: str, msg: str) -> WorkloadError:
        return located(self.path, self.line, f"field '{name}': {msg}")

    def has(self, name: str) -> bool:
        """Whether an optional field is present (null counts as absent)."""
        return self.record.get(name) is not None

    def get(self, name: str) -> Any:
        if name not in self.record:
            raise self.error(name, "missing")
        return self.record[name]

    def count(self, name: str) -> int:
        """A non-negative integer field (bools and floats are rejected)."""
        v = self.get(name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise self.error(name, f"expected a non-negative integer, got {show(v)}")
        return v

    def seconds(self, name: str, per_second: int = 1) -> float:
        """A finite, non-negative time (number, or numeric string) in units of 1/per_second s."""
        v = self.get(name)
        x = to_seconds(v)
        if x is None:
            raise self.error(name, f"expected a non-negative number, got {show(v)}")
        return x / per_second

    def string(self, name: str) -> str:
        v = self.get(name)
        if not isinstance(v, str):
            raise self.error(name, f"expected a string, got {show(v)}")
        return v


def to_seconds(v: Any) -> float | None:
    """`v` as a finite non-negative float, or None; accepts numbers and numeric strings."""
    if isinstance(v, bool):
        return None
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            return None
    if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        return None
    return float(v)


def not_text(path: str, line: int, raw: bytes, e: UnicodeDecodeError) -> WorkloadError:
    """The error for a line that is not UTF-8: names the first bad byte and its column."""
    return located(path, line, f"not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                   "is this a trace file?")


GZIP_MAGIC, ZSTD_MAGIC = b"\x1f\x8b", b"\x28\xb5\x2f\xfd"


def open_bytes(path: str) -> BinaryIO:
    """`path` opened for reading bytes, decompressed as it streams when it is gzip (or zstd, with
    the `zstandard` package); a folder or an unreadable file is a WorkloadError."""
    try:
        f = open(path, "rb")
    except IsADirectoryError:
        raise WorkloadError(f"{path}: is a folder, expected a file") from None
    except OSError as e:
        raise WorkloadError(f"{path}: cannot read ({e.strerror or e})") from None
    head = f.peek(4)[:4]
    if head[:2] == GZIP_MAGIC:
        import gzip

        return gzip.GzipFile(fileobj=f, mode="rb")  # type: ignore[return-value]
    if head == ZSTD_MAGIC:
        try:
            import zstandard
        except ImportError:
            f.close()
            raise WorkloadError(f"{path}: zstd-compressed; decompress it (zstd -d) or pip install zstandard") from None
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(f, closefd=True))  # type: ignore[arg-type]
    return f


def text_lines(path: str) -> Iterator[tuple[int, str | WorkloadError]]:
    """(line number, text) of every line, decoded as UTF-8 line by line (so a bad byte is
    reported with its line; a byte-order mark at the start is dropped); a line that is not
    UTF-8 yields its WorkloadError instead. A compressed file that breaks off is a WorkloadError."""
    with open_bytes(path) as f:
        lineno = 0
        try:
            for lineno, raw in enumerate(f, start=1):
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield lineno, not_text(path, lineno, raw, e)
                    continue
                yield lineno, text[1:] if lineno == 1 and text.startswith("\ufeff") else text
        except (OSError, EOFError) as e:  # a truncated or corrupt gzip stream
            raise located(path, lineno + 1, f"cannot decompress ({e})") from None


def json_lines(path: str) -> Iterator[tuple[int, Any]]:
    """(line number, parsed JSON) for each non-blank line; blank lines are skipped.

    A line that is not UTF-8 or not JSON yields a WorkloadError in place of the
    record, so the caller's skip policy decides what happens to it.
    """
    for lineno, text in text_lines(path):
        if isinstance(text, WorkloadError):
            yield lineno, text
            continue
        if not text.strip():
            continue
        try:
            yield lineno, json.loads(text)
        except json.JSONDecodeError as e:
            yield lineno, located(path, lineno, f"invalid JSON: {e.msg} (column {e.colno})")


def guarded(
    workload: Workload,
    path: str,
    items: Iterator[tuple[int, Any]],
    convert: Callable[[int, Any], Request],
    *,
    skip_bad: bool,
    time_field: str | None,
    unique_ids: bool = False,
) -> Iterator[Request]:
    """Convert (line, record) items to requests, applying the bad-line policy.

    A bad item raises its WorkloadError, or with `skip_bad` is counted on
    `workload.skipped`. With `time_field` set, arrivals must not decrease: an
    out-of-order line is an error naming that field. With `unique_ids` (a format whose ids the
    file gives), a second request with an id already seen is a bad line too.
    """
    workload.skipped = 0
    workload.skipped_errors = []
    last = -math.inf
    last_line = 0
    seen: dict[str, int] = {}
    n = 0
    for lineno, item in items:
        try:
            if isinstance(item, WorkloadError):
                raise item
            req = convert(lineno, item)
            if unique_ids:
                first = seen.setdefault(req.id, lineno)
                if first != lineno:
                    raise located(path, lineno, f"field 'id': duplicate request id {req.id!r} (first on line {first})")
            if time_field is not None and req.arrival < last:
                raise located(
                    path,
                    lineno,
                    f"field '{time_field}': timestamps must not decrease, got arrival "
                    f"{req.arrival:g} s after {last:g} s (line {last_line}); sort the file by time",
                )
        except WorkloadError as e:
            if not skip_bad:
                raise
            note_skipped(workload, e)
            continue
        last, last_line = req.arrival, lineno
        yield req
        n += 1
    if not n:  # a header alone, or nothing: no run of it can mean anything
        skipped = f" ({workload.skipped:,} bad lines skipped)" if workload.skipped else ""
        raise WorkloadError(f"{path}: no requests{skipped}")


def jsonl_workload(path: str, parse: Callable[[int, Any], Request], *, skip_bad: bool,
                   time_field: str, unique_ids: bool = False) -> Workload:
    """A streamed workload over a sorted JSON Lines file; `parse(line, record)` makes each request."""
    wl = Workload(
        lambda: guarded(wl, path, json_lines(path), parse, skip_bad=skip_bad, time_field=time_field,
                        unique_ids=unique_ids),
        Path(path).name,
    )
    return wl


def note_skipped(workload: Workload, error: WorkloadError) -> None:
    """Count one skipped bad line on the workload, keeping the first few messages."""
    workload.skipped += 1
    if len(workload.skipped_errors) < MAX_KEPT_ERRORS:
        workload.skipped_errors.append(str(error))
