"""The console script's exit (`sim.cli.app.main`): it skips the interpreter's teardown, and must
still give every byte of output, the exit code and the atexit handlers a normal exit gives."""

from __future__ import annotations

import subprocess
import sys

import pytest

NORMAL = "import sys; from sim.cli.app import app; sys.argv = ['kvsim', *sys.argv[1:]]; app()"
FAST = "import sys; from sim.cli.app import main; sys.argv = ['kvsim', *sys.argv[1:]]; main()"


def _run(entry: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", entry, *argv], capture_output=True, text=True)


@pytest.mark.parametrize("argv", [
    ["--help"],  # exit 0
    ["no-such-command"],  # a usage error: 2
    ["run", "/no/such/workload.jsonl"],  # the command's own error: 2, its message on stderr
    ["workload", "generate", "shared-prefix", "-n", "2"],  # a missing option
])
def test_the_fast_exit_gives_what_a_normal_exit_gives(argv: list[str]) -> None:
    fast, normal = _run(FAST, *argv), _run(NORMAL, *argv)
    assert (fast.returncode, fast.stdout, fast.stderr) == (normal.returncode, normal.stdout, normal.stderr)


def test_a_long_output_is_flushed_whole_and_atexit_handlers_run(tmp_path) -> None:
    out = tmp_path / "w.jsonl"
    probe = (
        "import atexit, sys; from sim.cli.app import main; atexit.register(print, 'atexit ran'); "
        f"sys.argv = ['kvsim', 'workload', 'generate', 'shared-prefix', '-n', '50', '-o', {str(out)!r}]; main()"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0
    assert done.stdout.splitlines()[-1] == "atexit ran"
    assert len(out.read_text().splitlines()) == 50
