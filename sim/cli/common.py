"""What every `kvsim` command shares: the error exit and how a workload argument is opened."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from workloads.request import Workload


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print `error: <message>` on stderr and return the exit to raise: `raise fail(...) from None`."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def open_workload(path: Path | None, fmt: str, skip_bad: bool, seed: int) -> Workload:
    """The workload file, or the embedded default workload (seeded) when none is given."""
    if path is None:
        from workloads.default import default_workload

        return default_workload(seed)
    from workloads.traces import load_workload

    return load_workload(path, fmt, skip_bad=skip_bad)
