"""The `kvsim` command line: one root app that mounts each package's commands."""

from __future__ import annotations

import typer

from sim.cli_cache import register as _register_cache
from sim.cli_conform import register as _register_conform
from sim.cli_gpu import register as _register_gpu
from sim.cli_run import register as _register_run
from sim.cli_study import register as _register_study
from workloads.cli import workload_app

app = typer.Typer(
    name="kvsim",
    help="Simulate and validate paged KV-cache block management policies.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.add_typer(workload_app, name="workload")
_register_cache(app)
_register_gpu(app)
_register_study(app)
_register_run(app)
_register_conform(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
