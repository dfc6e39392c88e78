"""The `kvsim` command line: one root app that mounts each package's commands."""

from __future__ import annotations

import atexit
import os
import sys
import threading

import typer

from kvsim.sim.cli.cache import register as _register_cache
from kvsim.sim.cli.capacity import register as _register_capacity
from kvsim.sim.cli.conform import register as _register_conform
from kvsim.sim.cli.gpu import register as _register_gpu
from kvsim.sim.cli.run import register as _register_run
from kvsim.sim.cli.study import register as _register_study
from kvsim.sim.cli.workload import workload_app

app = typer.Typer(
    name="kvsim",
    help="Simulate and validate paged KV-cache block management policies.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help: rich and its markdown parser cost ~0.25 s at start-up
)
app.add_typer(workload_app, name="workload")
_register_cache(app)
_register_gpu(app)
_register_study(app)
_register_run(app)
_register_capacity(app)
_register_conform(app)


def main() -> None:
    """The `kvsim` console script: the app, then an exit that skips tearing the interpreter down
    (freeing a long run's objects and modules one by one costs about 0.1 s, and nothing needs it:
    every file is closed by then). The streams are flushed and atexit handlers run, as at a normal
    exit; with another thread alive, or output that cannot be flushed, it exits normally."""
    try:
        app()
        code: object = 0
    except SystemExit as e:  # click's standalone mode always ends this way
        code = e.code
    if isinstance(code, str) or threading.active_count() > 1:
        raise SystemExit(code)
    atexit._run_exitfuncs()  # then the streams, in the order the interpreter's own exit takes
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):  # a closed pipe: let the interpreter report it as it would
        raise SystemExit(code) from None
    os._exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
