"""The policy-study notebooks: each executes top to bottom on its small inputs, and is committed clean.

A notebook's first code cell sets `FULL = False` (what runs here); notebooks fall back to a
generated workload when a public trace is absent, so this never depends on ../shared/traces.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))


@pytest.mark.parametrize("path", PATHS, ids=[p.name for p in PATHS])
def test_notebook_executes(path: Path) -> None:
    nbformat = pytest.importorskip("nbformat", reason="nbformat not installed (pip install -e '.[dev]')")
    nbclient = pytest.importorskip("nbclient", reason="nbclient not installed (pip install -e '.[dev]')")
    pytest.importorskip("ipykernel", reason="ipykernel not installed (pip install -e '.[dev]')")
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}
    )
    # Only this notebook's own scratch folders (kvsim_nbNN_*): under pytest-xdist another
    # worker's notebook may be mid-run, with its folder still there.
    pattern = f"kvsim_nb{path.name[:2]}_*"
    before = set(Path(tempfile.gettempdir()).glob(pattern))
    try:
        client.execute()
    except CellExecutionError as e:
        pytest.fail(f"{path.name}: a cell failed\n{e}", pytrace=False)
    left = set(Path(tempfile.gettempdir()).glob(pattern)) - before
    assert not left, f"{path.name} left {sorted(map(str, left))} behind"


@pytest.mark.parametrize("path", PATHS, ids=[p.name for p in PATHS])
def test_notebook_committed_without_outputs(path: Path) -> None:
    nb = json.loads(path.read_text())
    dirty = [
        i
        for i, cell in enumerate(nb["cells"])
        if cell["cell_type"] == "code" and (cell.get("outputs") or cell.get("execution_count") is not None)
    ]
    assert not dirty, f"{path.name}: code cells {dirty} have outputs or execution counts; strip them"


@pytest.mark.parametrize("path", PATHS, ids=[p.name for p in PATHS])
def test_notebook_conventions(path: Path) -> None:
    """First a markdown cell (the question), then the parameter cell with `FULL = False`."""
    cells = json.loads(path.read_text())["cells"]
    assert cells and cells[0]["cell_type"] == "markdown", f"{path.name}: must open with a markdown cell"
    first_code = next(c for c in cells if c["cell_type"] == "code")
    src = "".join(first_code["source"])
    assert src.lstrip().startswith("FULL = False"), (
        f"{path.name}: the first code cell must start with `FULL = False` (the parameter cell)"
    )
