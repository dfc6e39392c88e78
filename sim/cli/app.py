"""The `kvsim` command line: one root app that mounts each package's commands."""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from typing import Annotated

import typer

from kvsim.sim.cli.cache import register as _register_cache
from kvsim.sim.cli.capacity import register as _register_capacity
from kvsim.sim.cli.conform import register as _register_conform
from kvsim.sim.cli.gpu import register as _register_gpu
from kvsim.sim.cli.model import register as _register_model
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


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"kvsim {version('kvsim')}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="print kvsim's version and exit")] = False,
) -> None:
    """Simulate and validate paged KV-cache block management policies."""


app.add_typer(workload_app, name="workload")
_register_cache(app)
_register_gpu(app)
_register_study(app)
_register_run(app)
_register_capacity(app)
_register_conform(app)
_register_model(app)


def main() -> None:
    """The `kvsim` console script: the app, then an exit that skips tearing the interpreter down
    (freeing a long run's objects and modules one by one costs about 0.1 s, and nothing needs it:
    every file is closed by then). The streams are flushed and atexit handlers run, as at a normal
    exit; with another thread alive, or output that cannot be flushed, it exits normally."""
    interrupted: list[int] = []

    def stop(signum: int, frame: object) -> None:  # unwind: scratch folders go, children are stopped
        interrupted.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        app()
        code: object = 0
    except SystemExit as e:  # click's standalone mode always ends this way
        code = e.code
    except KeyboardInterrupt:  # (one that arrived after click's own handler)
        interrupted.append(signal.SIGINT)
    if interrupted:
        sys.stderr.write("interrupted: stopped, and nothing half-written was left behind (outputs are "
                         "written whole or not at all)\n")
        code = 128 + interrupted[0]
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
