"""`kvsim workload ...`: generate synthetic workloads and describe any workload file."""

from __future__ import annotations

import typer

workload_app = typer.Typer(help="Generate workloads and print their statistics.", no_args_is_help=True)
