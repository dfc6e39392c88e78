"""The core and the CLI must not pull in torch or triton."""

import subprocess
import sys


def test_core_and_cli_import_without_torch():
    code = ("import sys, gpu, kvcache.manager, sim.cli.app; "
            "print(sorted(m for m in ('torch', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
