"""`kvsim --help` and each command's `--help` import no heavy library (issue 15: instant CLI)."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("numpy", "pandas", "matplotlib", "simpy", "torch", "triton", "rich", "pyarrow", "vllm")

PROBE = """
import sys
from kvsim.sim.cli.app import app
sys.argv = ["kvsim", *{argv!r}]
try:
    app()
except SystemExit:
    pass
print("heavy:" + ",".join(sorted(m for m in {heavy!r} if m in sys.modules)))
"""


@pytest.mark.parametrize("argv", [
    ["--help"], ["cache-replay", "--help"], ["run", "--help"], ["sweep", "--help"],
    ["gpu-replay", "--help"], ["conform", "--help"], ["workload", "generate", "--help"],
])
def test_help_imports_nothing_heavy(argv: list[str]) -> None:
    probe = PROBE.format(argv=argv, heavy=HEAVY)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines()[-1] == "heavy:"


def test_names_match_what_the_loaders_and_generators_take() -> None:
    from kvsim.workloads import names
    from kvsim.workloads.arrivals import make_arrivals
    from kvsim.workloads.build import GENERATORS
    from kvsim.workloads.traces import LOADERS

    assert names.FORMATS == ("auto", *LOADERS)
    assert set(names.KINDS) == {*GENERATORS, "default"}
    for kind in names.ARRIVALS:
        make_arrivals(kind, 1.0)
