"""The install layout: every source folder installs beneath `kvsim` (pyproject.toml)."""

from __future__ import annotations

import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("sim", "kvcache", "gpu", "workloads")


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_folder_is_installed_beneath_kvsim():
    folders = {"kvsim"} | {
        "kvsim." + ".".join(p.parent.relative_to(ROOT).parts)
        for src in SOURCES for p in (ROOT / src).rglob("__init__.py")
    }
    assert set(_setuptools()["packages"]) == folders


def test_each_source_folder_maps_to_its_kvsim_name():
    assert _setuptools()["package-dir"] == {"kvsim": "kvsim", **{f"kvsim.{s}": s for s in SOURCES}}


def test_no_code_imports_a_source_folder_by_its_bare_name():
    """A bare `import sim` would find a user's own sim.py first (or nothing, once installed)."""
    import ast

    bad = []
    for d in (*SOURCES, "kvsim", "tests", "benchmarks", "notebooks"):
        for path in (ROOT / d).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
                bad += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n.split(".")[0] in SOURCES]
    assert bad == []
