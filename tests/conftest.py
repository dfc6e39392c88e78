"""Fixtures: the public traces folder (skip when absent), a writer for small input files, the first
requests of a golden workload as a trace of their own; the `needs_vllm` marker (skip without vLLM 0.33.0, fail where KVSIM_REQUIRE_VLLM=1, as in CI)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "golden" / "workloads"
REQUIRE_VLLM = "KVSIM_REQUIRE_VLLM"  # =1: a test marked needs_vllm fails, not skips, without vLLM


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"needs_vllm: runs against vLLM 0.33.0; skipped without it, failed where {REQUIRE_VLLM}=1")


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A `needs_vllm` test without an importable vLLM: skipped, or failed under KVSIM_REQUIRE_VLLM=1
    (CI installs vLLM, so a broken install must not pass as skipped conformance tests)."""
    if item.get_closest_marker("needs_vllm") is None:
        return
    from kvsim.sim.conform import vllm_setup

    missing = vllm_setup.vllm_available()
    if missing is None:
        return
    if os.environ.get(REQUIRE_VLLM) == "1":
        pytest.fail(f"{REQUIRE_VLLM}=1: {missing}", pytrace=False)
    pytest.skip(missing)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The notebooks' runs first (15-75 s each, nothing shared with other tests): near the end of a run
    pytest-xdist hands each worker consecutive tests in chunks, and a chunk of notebooks kept one
    worker busy while the other had nothing left to run."""
    notebooks = [item for item in items if getattr(item, "originalname", None) == "test_notebook_executes"]
    if notebooks:
        items[:] = notebooks + [item for item in items if item not in notebooks]


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


@pytest.fixture(scope="session")
def golden_head(tmp_path_factory: pytest.TempPathFactory):
    """golden_head(name, n, file) -> a trace file named `file` of golden workload `name`'s first `n`
    lines (its first `n` requests, in arrival order), written once a session."""
    made: dict[tuple[str, int, str], Path] = {}

    def _head(name: str, n: int, file: str) -> Path:
        if (name, n, file) not in made:
            path = tmp_path_factory.mktemp("golden") / file
            path.write_text("".join((GOLDEN / name).read_text().splitlines(keepends=True)[:n]))
            made[name, n, file] = path
        return made[name, n, file]

    return _head
