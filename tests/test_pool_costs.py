"""benchmarks/pool_costs.py: the pool's operations counted and timed inside a whole `kvsim run`."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_counts_agree_with_the_run_it_timed(tmp_path: Path) -> None:
    """On the embedded workload (512 blocks, LRU, every block used): the blocks taken off the free
    queue's linked part are the run's evictions (the pool starts with its 511 usable blocks on the
    front stack, taken there first), and every operation was seen and timed."""
    out = tmp_path / "run"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks/pool_costs.py"), "--out", str(out)],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stderr
    row = json.loads(run.stdout.strip().splitlines()[-1])
    summary = json.loads((out / "summary.json").read_text())
    take = row["ops"]["take"]
    assert take["blocks"] - take["from_front_stack"] == summary["evictions"]
    assert take["from_front_stack"] >= summary["num_gpu_blocks"] - 1
    assert (summary["evictions"], summary["num_gpu_blocks"]) == (5486, 512)
    for op in ("take", "free", "cache"):
        assert row["ops"][op]["calls"] > 0 and row["ops"][op]["blocks"] > 0 and row["ops"][op]["seconds"] >= 0
    assert row["steps"]["general"] + row["steps"]["quiet"] >= summary["steps"]
    assert 0 < row["pool_share"] < 1


def test_a_refused_option_exits_as_kvsim_does(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks/pool_costs.py"), "--num-gpu-blocks", "1"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert run.returncode != 0
    assert "num_gpu_blocks" in run.stderr or "num-gpu-blocks" in run.stderr
    assert "{" not in run.stdout
