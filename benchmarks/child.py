"""Run one command in a fresh child process and take its own wall time and peak memory."""

from __future__ import annotations

import os
import subprocess
import time


def run_child(cmd: list[str], *, env: dict | None = None, cwd=None, ok: tuple[int, ...] = (0,)) -> tuple[bytes, float, float]:
    """`cmd`'s stdout, wall seconds and peak resident set size in MiB (the kernel's accounting of
    this child alone, from wait4); an exit code outside `ok` stops the benchmark."""
    t0 = time.perf_counter()
    child = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE)
    out = child.stdout.read()
    child.stdout.close()
    _, status, usage = os.wait4(child.pid, 0)  # this child's own rusage, not all children's
    child.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if child.returncode not in ok:
        raise SystemExit(f"{' '.join(cmd)} exited with {child.returncode}")
    return out, wall, usage.ru_maxrss / 1024
