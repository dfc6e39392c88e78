"""Capacity curves: exact replay points on a hand-built workload, tables, plots, CLI."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from kvsim.sim.cli.app import app
from kvsim.sim.engine.config import ConfigError
from kvsim.sim.studies.curves import (
    capacity_curve,
    check_points,
    format_table,
    replay_point,
    sim_point,
    write_curve,
)
from kvsim.sim.studies.sweep import WorkloadSpec
from kvsim.workloads import make_request, write_jsonl

runner = CliRunner()


@pytest.fixture
def acb(tmp_path: Path) -> WorkloadSpec:
    """A (40 tokens), C (48 other tokens), B (A's prompt again); one output token each."""
    a = list(range(1000, 1040))
    c = list(range(2000, 2048))
    reqs = [
        make_request("A", 0.0, a, 1),
        make_request("C", 1.0, c, 1),
        make_request("B", 2.0, a, 1),
    ]
    path = tmp_path / "acb.jsonl"
    write_jsonl(reqs, path)
    return WorkloadSpec(str(path))


def test_replay_point_with_room_for_both_prompts(acb: WorkloadSpec) -> None:
    # 7 usable blocks. A's uncached tail block 3 goes back to the front of the free queue
    # (vLLM 0.33 BlockPool.free_blocks), so C takes 3-5; B hits A's two full blocks (ids 1, 2)
    # and gets block 6 for its tail. Sampled at each free: A {1,2,3}, C {3,4,5}, B {1,2,6}.
    row = replay_point(acb, "lru", 8, 16)
    assert row == {
        "policy": "lru",
        "capacity": 8,
        "hit_rate": 32 / 128,
        "block_hit_rate": 2 / 9,
        "evicted_blocks": 0,
        "mean_id_fragmentation": (0 + 2 + 3) / 3,
        "mean_internal_fragmentation": (7 + 0 + 7) / 3,
        "requests": 3,
        "rejected": 0,
    }


def test_replay_point_when_c_evicts_a(acb: WorkloadSpec) -> None:
    # 3 usable blocks: C evicts A's two cached blocks, B misses and evicts C's three
    row = replay_point(acb, "lru", 4, 16)
    assert (row["hit_rate"], row["block_hit_rate"], row["evicted_blocks"]) == (0.0, 0.0, 5)
    assert row["mean_id_fragmentation"] == 0.0


def test_capacity_curve_rows_sorted_and_parallel_matches_serial(acb: WorkloadSpec) -> None:
    serial = capacity_curve(acb, [8, 4, 16], ["s3fifo", "lru"], workers=1)
    assert list(zip(serial["policy"], serial["capacity"], strict=True)) == [
        ("s3fifo", 4), ("s3fifo", 8), ("s3fifo", 16), ("lru", 4), ("lru", 8), ("lru", 16),
    ]  # fmt: skip
    assert list(serial.loc[serial["policy"] == "lru", "hit_rate"]) == [0.0, 0.25, 0.25]
    parallel = capacity_curve(acb, [8, 4, 16], ["s3fifo", "lru"], workers=2)
    pd.testing.assert_frame_equal(serial, parallel)


def test_sim_mode_point_matches_the_simulator(acb: WorkloadSpec) -> None:
    from kvsim.sim.engine.config import SimConfig
    from kvsim.sim.engine.run import simulate

    row = sim_point(acb, "lru", 8, 16)
    s = simulate(acb.open(), SimConfig(num_gpu_blocks=8, eviction="lru")).summary
    assert (row["hit_rate"], row["evicted_blocks"]) == (s["hit_rate"], s["evictions"])
    assert row["mean_id_fragmentation"] == s["mean_id_fragmentation"]


def test_check_points_errors() -> None:
    with pytest.raises(ConfigError, match="capacity must be at least 2 blocks"):
        check_points([100, 1], ["lru"], 16, "replay")
    with pytest.raises(ConfigError, match="unknown eviction policy 'mru'; choose from lru, "):
        check_points([100], ["lru", "mru"], 16, "replay")
    with pytest.raises(ConfigError, match="unknown mode 'fast'; choose from replay, sim"):
        check_points([100], ["lru"], 16, "fast")
    with pytest.raises(ConfigError, match="block_size must be a positive power of two, got 12"):
        check_points([100], ["lru"], 12, "replay")


def test_format_table() -> None:
    df = pd.DataFrame(
        {"policy": ["lru", "lru", "fifo", "fifo"], "capacity": [100, 2000, 100, 2000],
         "hit_rate": [0.1, 0.5, 0.05, 0.25], "mean_id_fragmentation": [1.0, 2.5, 3.0, 4.25]}
    )  # fmt: skip
    assert format_table(df) == (
        "capacity    lru   fifo\n     100  10.00   5.00\n   2,000  50.00  25.00"
    )
    assert format_table(df, "mean_id_fragmentation", percent=False).splitlines()[2] == (
        "   2,000  2.5   4.2"
    )


def test_write_curve(acb: WorkloadSpec, tmp_path: Path) -> None:
    df = capacity_curve(acb, [4, 8], ["lru", "fifo"])
    out = write_curve(df, tmp_path / "c", "acb.jsonl", 16, "replay")
    pd.testing.assert_frame_equal(pd.read_parquet(out / "curve.parquet"), df)
    assert (out / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_curve_cli(acb: WorkloadSpec, tmp_path: Path) -> None:
    res = runner.invoke(
        app,
        ["curve", acb.path, "-c", "4,8", "-p", "lru,fifo", "-w", "1", "-o", str(tmp_path / "o")],
    )
    assert res.exit_code == 0, res.output
    assert "capacity    lru   fifo\n       4   0.00   0.00\n       8  25.00  25.00" in res.output
    assert (tmp_path / "o" / "curve.png").is_file()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-c", "1,8"], "error: capacity must be at least 2 blocks (block 0 is reserved), got 1\n"),
        (["-c", "8", "-p", "lru,nope"], "error: unknown eviction policy 'nope'; choose from "),
        (["-c", "8,x"], "error: --capacities must be comma-separated integers, got '8,x'\n"),
        (["-c", "8", "--no-async-scheduling"], "error: --no-async-scheduling needs --mode sim (mode replay "
                                              "replays the cache alone, with no scheduler)\n"),
    ],
)
def test_curve_cli_errors(acb: WorkloadSpec, args: list[str], message: str) -> None:
    res = runner.invoke(app, ["curve", acb.path, *args])
    assert res.exit_code == 2
    assert res.output.startswith(message)
    assert len(res.output.splitlines()) == 1
    assert "Traceback" not in res.output


def test_curve_cli_missing_workload(tmp_path: Path) -> None:
    res = runner.invoke(app, ["curve", str(tmp_path / "none.jsonl"), "-c", "8"])
    assert res.exit_code == 2
    assert res.output == f"error: {tmp_path / 'none.jsonl'}: no such file or directory\n"


def test_curve_sim_mode_takes_the_scheduler_mode(tmp_path: Path) -> None:
    """Sim mode runs `kvsim run`'s default scheduler, async as `vllm serve` 0.33; the flags pick either
    (the golden multi-turn workload at 32 blocks: 29.13% async, 29.78% sync, as tests/golden pins)."""
    golden = Path(__file__).resolve().parents[2] / "golden/workloads/multi-turn.jsonl"
    rows = {}
    for flag in ("", "--async-scheduling", "--no-async-scheduling"):
        res = runner.invoke(app, ["curve", str(golden), "-c", "32", "-m", "sim", "-w", "1",
                                  "-o", str(tmp_path / (flag or "default")), *([flag] if flag else [])])
        assert res.exit_code == 0, res.output
        rows[flag] = res.stdout.splitlines()[4].split()
    assert rows == {"": ["32", "29.13"], "--async-scheduling": ["32", "29.13"], "--no-async-scheduling": ["32", "29.78"]}
