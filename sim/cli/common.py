"""What every `kvsim` command shares: the error exit, how a workload argument is opened, and
output paths that are checked before the work and written whole or not at all."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from kvsim.workloads.request import Workload


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print `error: <message>` on stderr and return the exit to raise: `raise fail(...) from None`."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def open_workload(path: Path | None, fmt: str, skip_bad: bool, seed: int) -> Workload:
    """The workload file, or the embedded default workload (seeded) when none is given."""
    if path is None:
        from kvsim.workloads.default import default_workload

        return default_workload(seed)
    from kvsim.workloads.traces import load_workload

    return load_workload(path, fmt, skip_bad=skip_bad)


def cannot_write(path: Path, e: OSError, code: int = 2) -> typer.Exit:
    """The exit for an output that failed to write: `raise cannot_write(path, e) from None`."""
    return fail(f"{path}: cannot write ({e.strerror or e})", code)


def check_output(path: Path, *, folder: bool = False, code: int = 2) -> None:
    """Fail before any work when `path` cannot be written: a folder where a file goes (or the
    reverse), a missing parent (files) or one that is a file, or a place that refuses a new
    file (probed by making and removing one)."""
    if folder and path.exists() and not path.is_dir():
        raise fail(f"{path}: exists and is not a folder", code)
    if not folder and path.is_dir():
        raise fail(f"{path}: is a folder, expected a file name", code)
    anchor = path if folder else path.parent
    while folder and not anchor.exists() and anchor != anchor.parent:
        anchor = anchor.parent  # a run folder's missing parents are created
    if not anchor.is_dir():
        what = "is not a folder" if anchor.exists() else "does not exist"
        raise fail(f"{path}: cannot write there ({anchor} {what})", code)
    try:
        fd, probe = tempfile.mkstemp(dir=anchor, prefix=".kvsim-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise fail(f"{path}: cannot write there ({e.strerror or e})", code) from None


@contextmanager
def staged_file(path: Path, code: int = 2) -> Iterator[Path]:
    """A temporary path beside `path` to write; renamed to `path` when the block ends cleanly,
    removed when it raises, so a failed command leaves no half-written file."""
    check_output(path, code=code)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        try:
            os.chmod(tmp, 0o644)  # mkstemp makes it private; outputs are meant to be shared
            os.replace(tmp, path)
        except OSError as e:
            raise cannot_write(path, e, code) from None
    finally:
        tmp.unlink(missing_ok=True)


def progress_bar(workload: Workload, label: str = "simulating"):
    """A rich progress bar on stderr (requests done), or None when stderr is not a terminal."""
    if not sys.stderr.isatty():
        return None, None
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    total = sum(1 for _ in workload)  # one cheap pass (prompts stay lazy) for the bar's total
    bar = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TextColumn("requests"),
                   TimeElapsedColumn(), console=Console(stderr=True), transient=True)
    task = bar.add_task("run", total=total)
    return bar, lambda n: bar.update(task, completed=n)
