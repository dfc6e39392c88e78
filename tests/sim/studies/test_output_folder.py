"""An output folder written again (`staged_folder`): the new output replaces what kvsim wrote there
before, whole (no table, plot or replica folder of the earlier run is left beside the new one's),
files kvsim does not write stay, and a move that fails puts everything back."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvsim.sim.cli.app import app
from kvsim.sim.studies import run_folder
from kvsim.sim.studies.cluster_folder import is_cluster_folder
from kvsim.sim.studies.run_folder import owned, read_summary, staged_folder

WORKLOAD = Path(__file__).resolve().parents[2] / "golden" / "workloads" / "multi-turn.jsonl"
SMALL = ["--num-gpu-blocks", "64", "--max-num-batched-tokens", "256", "--no-plots"]


def _run(*args: str) -> None:
    r = CliRunner().invoke(app, ["run", str(WORKLOAD), *SMALL, *args])
    assert r.exit_code == 0, r.output


def _entries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_a_run_replaces_the_earlier_run_in_its_folder(tmp_path: Path) -> None:
    out = tmp_path / "run"
    _run("--replicas", "3", "--router", "round-robin", "--out", str(out))
    assert "replica-2" in _entries(out) and is_cluster_folder(out)
    (out / "notes.txt").write_text("mine")
    (out / "logo.png").write_bytes(b"mine too")  # (a plot kvsim does not write: not its to replace)
    # a smaller cluster where a larger one ran (a replica folder can not be moved onto a full one)
    _run("--replicas", "2", "--router", "round-robin", "--out", str(out))
    assert _entries(out) == ["config.json", "load.parquet", "logo.png", "notes.txt", "received.parquet", "replica-0",
                             "replica-1", "summary.json"]
    assert len(read_summary(out)["cluster"]["per_replica"]) == 2
    # one replica where a cluster ran: nothing of the cluster is left to pass it off as one
    _run("--record-ops", "--out", str(out))
    assert _entries(out) == ["config.json", "logo.png", "notes.txt", "op_tokens.parquet", "ops.parquet",
                             "requests.parquet", "steps.parquet", "summary.json"]
    assert not is_cluster_folder(out)
    # and without op records where they were recorded: none left to replay a run they do not belong to
    _run("--out", str(out))
    assert _entries(out) == ["config.json", "logo.png", "notes.txt", "requests.parquet", "steps.parquet",
                             "summary.json"]


def test_what_kvsim_writes_at_a_folders_top_is_owned(tmp_path: Path) -> None:
    """Every entry each writer puts at a folder's top is named in `OUTPUTS` (or is a replica folder):
    a run with op records in vLLM's hybrid groups with plots, a cluster, a P/D cluster, a curve; and
    nothing else is, not even another table or plot of the user's."""
    runs = {"run": ["run", "--model", "gpt-oss-20b", "--record-ops"],
            "cluster": ["run", "--replicas", "2", "--router", "round-robin"],
            "pd": ["run", "--prefill-replicas", "1", "--decode-replicas", "1"]}
    for name, args in runs.items():
        r = CliRunner().invoke(app, [*args, str(WORKLOAD), "--num-gpu-blocks", "400", "--out", str(tmp_path / name)])
        assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["curve", str(WORKLOAD), "-c", "64,128", "-p", "lru", "-o", str(tmp_path / "curve")])
    assert r.exit_code == 0, r.output
    written = {p.name for d in tmp_path.iterdir() for p in d.iterdir()}
    assert {"groups.parquet", "ops.parquet", "cluster.png", "pd.png", "curve.png", "replica-1"} <= written
    assert all(owned(n) for n in written), sorted(n for n in written if not owned(n))
    for name in ("notes.txt", "my.json", "trace.parquet", "logo.png", "replica-", "replica-x", "ops", "trace.jsonl",
                 "sub/steps.parquet"):
        assert not owned(name), name


def test_a_failed_move_puts_the_folder_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    (out / "replica-0").mkdir(parents=True)
    (out / "replica-0" / "steps.parquet").write_text("old replica")
    (out / "summary.json").write_text("old")
    (out / "notes.txt").write_text("mine")
    before = {p.relative_to(out): p.read_text() for p in out.rglob("*") if p.is_file()}
    real, moves = os.replace, []

    def flaky(src, dst):  # the third move into the folder fails
        if Path(dst).parent == out:
            moves.append(dst)
            if len(moves) == 3:
                raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(run_folder.os, "replace", flaky)
    with pytest.raises(OSError, match="No space left"), staged_folder(out) as d:
        for name in ("config.json", "summary.json", "steps.parquet"):
            (d / name).write_text("new")
    monkeypatch.undo()
    assert {p.relative_to(out): p.read_text() for p in out.rglob("*") if p.is_file()} == before
    assert _entries(tmp_path) == ["out"]  # no staging or set-aside folder left beside it
