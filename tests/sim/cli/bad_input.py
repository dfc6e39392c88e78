"""Shared by the bad-input CLI tests: small bad files in the current folder, and the check that a
command answered with one `error:` line, a non-zero exit, no traceback and nothing written."""

from __future__ import annotations

import json
import os
from pathlib import Path

from typer.testing import CliRunner

from kvsim.sim.cli.app import app
from kvsim.workloads.jsonl import write_jsonl
from kvsim.workloads.ragpulse import KINDS
from tests.sim.engine.engine_fixtures import req

PNG = b"\x89PNG\r\n\x1a\n" + bytes(64)  # an image given as a trace: not UTF-8 from byte one
AZ_HEAD = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
MOON = {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}


def write_files(root: Path) -> None:
    """The inputs every case names, relative to `root` (the test's current folder)."""
    write_jsonl([req("a", 0, 40, 5), req("b", 0.1, 40, 5)], root / "ok.jsonl")
    files: dict[str, str | bytes] = {
        "png.jsonl": PNG,
        "empty.jsonl": "",
        "bin.csv": AZ_HEAD,
        "nan.csv": AZ_HEAD + "2023-11-16 18:17:03.9799600,NaN,5\n",
        "inf.jsonl": json.dumps(MOON).replace('"timestamp": 0', '"timestamp": 1e999') + "\n",
        "kvnan.jsonl": '{"id": "a", "arrival": NaN, "prompt": [1], "output_len": 2}\n',
        "late_bad.jsonl": (root / "ok.jsonl").read_text() + '{"id": "c", "arrival": 1, "prompt": [1], "output_len": -3}\n',
        "rp/0_trace.jsonl": '{"timestamp": "0", "input_length": 5, "output_length": 2, "hash_ids": {}}\n',
        "rp_bin/0_trace.jsonl": PNG,
        **{f"rp_bin/{name}": "" for _, name, _ in KINDS},
        "cal_nan.json": '{"overhead_s": NaN}',
        "cal_inf.json": '{"efficiency": {"compute": Infinity}}',
        "cal.json": '{"version": 1}',
        "fakerun/summary.json": "{}",
    }
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    with open(root / "bin.csv", "ab") as f:
        f.write(b"\xff\xfe,1,2\n")
    (root / "adir").mkdir()


def tree(root: Path) -> set[str]:
    """Every path under `root`, relative, to compare before and after a command."""
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def assert_one_error(args: list[str], message: str, code: int = 2) -> None:
    """`kvsim ARGS` prints exactly `error: MESSAGE` on stderr, exits `code` (no traceback) and
    leaves the current folder as it was."""
    root = Path(os.getcwd())
    before = tree(root)
    r = CliRunner().invoke(app, args)
    assert isinstance(r.exception, SystemExit), r.exception  # not an uncaught exception
    assert "Traceback" not in r.output
    assert r.exit_code == code, r.output
    assert r.stderr == f"error: {message}\n"
    assert tree(root) == before
