"""Fixtures: the public traces folder (skip when absent) and a writer for small input files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def traces_dir() -> Path | None:
    """$KVSIM_TRACES, else ../shared/traces next to the repo root, if it exists."""
    env = os.environ.get("KVSIM_TRACES")
    for cand in ([Path(env)] if env else []) + [REPO.parent / "shared" / "traces"]:
        if cand.is_dir():
            return cand
    return None


@pytest.fixture(scope="session")
def traces() -> Path:
    found = traces_dir()
    if found is None:
        pytest.skip("public traces not found (set KVSIM_TRACES)")
    return found


@pytest.fixture
def write(tmp_path: Path):
    """write(name, text) -> path of a new file under tmp_path."""

    def _write(name: str, text: str) -> Path:
        p = tmp_path / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        return p

    return _write
