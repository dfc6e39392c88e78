"""One entry point for every workload file: detect the format, pick the loader."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from kvsim.workloads.azure import load_azure
from kvsim.workloads.errors import WorkloadError, text_lines
from kvsim.workloads.jsonl import load_jsonl
from kvsim.workloads.mooncake import load_mooncake
from kvsim.workloads.names import FORMATS
from kvsim.workloads.ragpulse import TRACE_FILE, load_ragpulse
from kvsim.workloads.request import Workload

LOADERS: dict[str, Callable[..., Workload]] = {
    "mooncake": load_mooncake,
    "azure": load_azure,
    "ragpulse": load_ragpulse,
    "kvsim": load_jsonl,
}


def detect_format(path: str | Path) -> str:
    """Guess a file's format: a folder or `0_trace.jsonl` is RAGPulse, `.csv` is Azure,
    otherwise the first JSON record's fields decide (`prompt` kvsim, `hash_ids` list
    Mooncake, `hash_ids` object RAGPulse)."""
    p = Path(path)
    if not p.exists():
        raise WorkloadError(f"{p}: no such file or directory")
    if p.is_dir() or p.name == TRACE_FILE:
        return "ragpulse"
    compressed = p.suffix.lower() in (".gz", ".zst") and len(p.suffixes) > 1
    if (p.suffixes[-2] if compressed else p.suffix).lower() == ".csv":  # trace.csv, trace.csv.gz
        return "azure"
    for lineno, text in text_lines(str(p)):
        if isinstance(text, WorkloadError):
            raise text
        if not text.strip():
            continue
        try:
            rec = json.loads(text)
        except json.JSONDecodeError as e:
            raise WorkloadError(
                f"{p}:{lineno}: cannot tell the format, the first record is not JSON "
                f"({e.msg}, column {e.colno}); pass --format"
            ) from None
        if isinstance(rec, dict):
            if "prompt" in rec:
                return "kvsim"
            ids = rec.get("hash_ids")
            if isinstance(ids, list):
                return "mooncake"
            if isinstance(ids, dict):
                return "ragpulse"
        raise WorkloadError(
            f"{p}:{lineno}: cannot tell the format from the first record "
            f"(expected 'prompt' or 'hash_ids'); pass --format"
        )
    raise WorkloadError(f"{p}: empty, no records")


def load_workload(path: str | Path, format: str = "auto", *, skip_bad: bool = False) -> Workload:
    """Open a workload file as a streamed Workload.

    `format` is auto|mooncake|azure|ragpulse|kvsim. Bad records raise
    WorkloadError (possibly while iterating); with `skip_bad` they are skipped
    and counted on `Workload.skipped`.
    """
    if format not in FORMATS:
        raise WorkloadError(f"unknown format {format!r}; expected one of {', '.join(FORMATS)}")
    fmt = detect_format(path) if format == "auto" else format
    if not Path(path).exists():
        raise WorkloadError(f"{path}: no such file or directory")
    return LOADERS[fmt](path, skip_bad=skip_bad)
