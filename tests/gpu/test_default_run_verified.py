"""The whole default run, recorded and verified on the CPU (torch kernels): every step, 0 mismatches.

This is CI's end-to-end check of the op contract: `kvsim run --record-ops` on the embedded
workload, then `kvsim gpu-replay --device cpu`, as a user would type them.
"""

import json

from typer.testing import CliRunner

from kvsim.sim.cli.app import app

runner = CliRunner()


def test_default_run_verifies_with_zero_mismatches(tmp_path):
    run = tmp_path / "run"
    r = runner.invoke(app, ["run", "--record-ops", "--no-plots", "-o", str(run)])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["gpu-replay", str(run), "--device", "cpu", "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["kernels"] == "torch" and rep["mismatches"] == 0 and rep["first_mismatches"] == []
    assert rep["steps"] == rep["steps_checked"] == 9707
    assert rep["tokens_verified"] == 28_048_648 and rep["sequence_checks"] == 41_101
    assert rep["ops"] == {"write": 44_517, "table": 12_992, "free": 9_440, "evict": 5_486}
