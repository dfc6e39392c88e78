"""Small helpers shared by the notebooks: where the public traces are, trace slices, plot style.

Each notebook's first code cell sets `FULL` (full-size run or the small inputs CI
executes); this module only locates inputs. Notebooks run with `notebooks/` as
the working directory, so `import _nb` finds this file.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# $KVSIM_TRACES, else ../shared/traces next to the repo root (as the tests and benchmarks)
TRACES = Path(os.environ.get("KVSIM_TRACES", REPO.parent / "shared" / "traces"))


def trace(relpath: str) -> Path | None:
    """The trace file `relpath` under TRACES, or None when it is absent (fall back to a generated workload)."""
    p = TRACES / relpath
    return p if p.exists() else None


def spec(relpath: str, n: int | None, fallback: dict):
    """A `sim.studies.sweep.WorkloadSpec` for the first `n` requests of trace `relpath`, or, when the trace
    is absent, for the generated workload `fallback` (`kvsim workload generate` options, with `kind`)."""
    from kvsim.sim.studies.sweep import WorkloadSpec

    p = trace(relpath)
    if p is None:
        print(f"{relpath} not found under {TRACES}: using a generated {fallback['kind']} workload")
        return WorkloadSpec(generator=tuple(fallback.items()))
    return WorkloadSpec(str(head(p, n)))


def head(path: str | Path, n: int | None) -> Path:
    """A copy of the first `n` requests of a JSONL or CSV trace (a CSV keeps its header), in a temp folder.

    `n=None` returns `path` itself. A file path (not a Workload) keeps study points picklable
    for `sim.studies.curves` and `sim.studies.sweep`, which run them on worker processes.
    """
    path = Path(path)
    if n is None:
        return path
    size = path.stat().st_size  # a different file under the same name gets its own slice
    out = Path(tempfile.gettempdir()) / "kvsim_nb" / f"{path.stem}_{size}_head{n}{path.suffix}"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        keep = n + (1 if path.suffix == ".csv" else 0)
        with path.open() as src:
            lines = [line for _, line in zip(range(keep), src, strict=False)]
        tmp = out.with_suffix(out.suffix + f".{os.getpid()}")
        tmp.write_text("".join(lines))
        tmp.replace(out)
    return out


def style() -> None:
    """One plot style for every notebook: readable sizes, light grid, inline-friendly dpi."""
    import matplotlib.pyplot as plt

    plt.rcParams.update(
        {
            "figure.figsize": (10, 4.2),
            "figure.dpi": 100,
            "axes.grid": True,
            "grid.alpha": 0.3,
            "axes.titlesize": 11,
            "legend.fontsize": 9,
        }
    )


def workload(relpath: str, n: int | None, fallback: dict):
    """A `kvsim` workload: the first `n` requests of trace `relpath`, or, when the trace is absent,
    the generated workload `fallback` (`kvsim.generate_workload` options, with `kind`)."""
    import kvsim

    p = trace(relpath)
    if p is None:
        print(f"{relpath} not found under {TRACES}: using a generated {fallback['kind']} workload")
        return kvsim.generate_workload(**fallback)
    return kvsim.load_workload(head(p, n))


def scratch(prefix: str) -> Path:
    """A temporary folder for a notebook's files, removed when its kernel exits (so a run leaves
    nothing in the temp folder)."""
    import atexit
    import shutil

    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path
