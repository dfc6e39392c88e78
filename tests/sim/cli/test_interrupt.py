"""An interrupted command (SIGTERM, or Ctrl-C to its process group) exits cleanly, says so and
leaves nothing behind: `kvsim run --record-ops` removes its scratch folder (its op-writer child
prints no traceback of its own), and `kvsim curve` stops its worker processes at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

MESSAGE = "interrupted: stopped, and nothing half-written was left behind (outputs are written whole or not at all)"


def _start(args: list[str], cwd) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvsim", *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_for(predicate, proc: subprocess.Popen, limit: float = 60.0) -> None:
    t0 = time.monotonic()
    while not predicate():
        if proc.poll() is not None or time.monotonic() - t0 > limit:
            proc.kill()
            pytest.fail(f"never started: {proc.communicate()}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wl")
    path = folder / "chat.jsonl"
    subprocess.run([sys.executable, "-m", "kvsim", "workload", "generate", "multi-turn", "-n", "4000",
                    "--seed", "1", "-o", str(path)], check=True, capture_output=True)
    return path


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT to the group", "SIGINT to the group at once"])
def test_an_interrupted_run_leaves_no_scratch_and_no_traceback(tmp_path, chat, how):
    """"at once": the op writer child may still be importing; it ignores SIGINT from its start (it
    printed a KeyboardInterrupt traceback of its own in about one try in three before)."""
    proc = _start(["run", str(chat), "--record-ops", "--no-plots", "-o", str(tmp_path / "run")], tmp_path)
    _wait_for(lambda: any(p.name.endswith(".scratch") for p in tmp_path.iterdir()), proc)
    time.sleep(0.02 if how.endswith("at once") else 0.5)  # the op writer is streaming by now, or starting
    if how == "SIGTERM":
        proc.send_signal(signal.SIGTERM)
    else:
        os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + (signal.SIGTERM if how == "SIGTERM" else signal.SIGINT)
    assert err.splitlines()[-1] == MESSAGE and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_an_interrupted_curve_stops_its_workers_without_finishing_their_points(tmp_path, chat):
    proc = _start(["curve", str(chat), "-c", "64,128,256,512", "-p", "lru,arc", "--mode", "sim", "-w", "2",
                   "-o", str(tmp_path / "cv")], tmp_path)
    time.sleep(3.0)  # points are running
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.splitlines()[-1] == MESSAGE and "Traceback" not in err
    finished = [line for line in err.splitlines() if line.lstrip().startswith("point ")]
    assert len(finished) < 8  # the running points were stopped, not waited for
    assert not (tmp_path / "cv").exists()
