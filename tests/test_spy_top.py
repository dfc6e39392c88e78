"""benchmarks/spy_top.py: a py-spy raw profile's samples tallied by own time and with callees."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from spy_top import tally  # noqa: E402


def test_tally_counts_own_time_and_each_frame_once_a_stack(tmp_path):
    profile = tmp_path / "p.txt"
    # a recursive frame (f twice in one stack) counts once for that stack
    profile.write_text("main;f;g 3\nmain;f 2\nmain;f;f 5\n\n")
    total, own, anywhere = tally(profile)
    assert total == 10
    assert own == {"g": 3, "f": 7}
    assert anywhere == {"main": 10, "f": 10, "g": 3}


def test_empty_profile_is_refused(tmp_path):
    profile = tmp_path / "p.txt"
    profile.write_text("")
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks/spy_top.py"), str(profile)],
                         capture_output=True, text=True)
    assert run.returncode == 1
    assert run.stderr == f"{profile}: no samples\n"
