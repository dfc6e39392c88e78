"""The `kvsim` command line: one root app that mounts each package's commands."""

from __future__ import annotations

import typer

from sim.cli.cache import register as _register_cache
from sim.cli.conform import register as _register_conform
from sim.cli.gpu import register as _register_gpu
from sim.cli.run import register as _register_run
from sim.cli.study import register as _register_study
from sim.cli.workload import workload_app

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
_register_conform(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
