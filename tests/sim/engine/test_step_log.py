"""The steps log: packed in memory or streamed to a parquet file, the same table either way."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from kvsim.sim.engine.config import SimConfig
from kvsim.sim.engine.metrics import STEP_COLUMNS, STEP_FIELDS
from kvsim.sim.engine.run import simulate
from kvsim.sim.engine.step_log import StepFile, StepLog
from kvsim.sim.studies.run_folder import load_run, write_run
from kvsim.workloads.build import build_workload


class SmallLog(StepLog):
    CHUNK = 3
    SEGMENT = 7  # not a multiple of CHUNK: a chunk that would overflow starts a new segment


def rows(n: int) -> list[tuple]:
    """n distinct rows: time 0.5 i, duration 0.25, context tokens past int32, the rest i + column."""
    special = {"time": lambda i: 0.5 * i, "duration": lambda i: 0.25, "context_tokens": lambda i: 3_000_000_000 + i}
    return [tuple(special[f](i) if f in special else i + j for j, f in enumerate(STEP_FIELDS)) for i in range(n)]


@pytest.mark.parametrize("n", [0, 1, 3, 7, 8, 20])
def test_streamed_and_in_memory_logs_give_the_same_table(tmp_path: Path, n: int) -> None:
    mem, disk = SmallLog(), SmallLog(tmp_path / "steps.parquet")
    for r in rows(n):
        mem.record(r)
        disk.record(r)
    assert len(mem) == len(disk) == n
    a, b = mem.frame(), disk.frame()
    assert list(a.columns) == list(STEP_FIELDS)
    assert a.dtypes.tolist() == [np.dtype(d) for d in STEP_COLUMNS.values()]
    pd.testing.assert_frame_equal(a, b)
    pd.testing.assert_frame_equal(StepFile(disk.path).frame(), a)
    assert len(StepFile(disk.path)) == n
    assert StepFile(disk.path)["internal_fragmentation"].tolist() == a["internal_fragmentation"].tolist()
    if n == 20:  # chunks of 3 fill segments of 7 with 6 rows: written as 4 row groups, 6 + 6 + 6 + 2
        assert [pq.ParquetFile(disk.path).metadata.row_group(g).num_rows for g in range(4)] == [6, 6, 6, 2]
    assert a["context_tokens"].tolist() == [3_000_000_000 + i for i in range(n)]
    assert a["time"].tolist() == [0.5 * i for i in range(n)]


def test_frame_twice_and_record_after_it() -> None:
    log = SmallLog()
    data = rows(10)
    for r in data[:8]:
        log.record(r)
    first = log.frame()
    pd.testing.assert_frame_equal(log.frame(), first)
    for r in data[8:]:
        log.record(r)
    assert log.frame()["running"].tolist() == [i + 2 for i in range(10)]


def test_a_streamed_run_equals_one_in_memory(tmp_path: Path) -> None:
    cfg = SimConfig(model="llama-3-8b", gpu="h100-sxm", block_size=16, num_gpu_blocks=64)
    wl = build_workload("shared-prefix", 60, 20.0, "poisson", 1.0, 3, {})
    mem = simulate(wl, cfg)
    streamed = simulate(wl, cfg, steps_file=tmp_path / "s.parquet")
    assert isinstance(streamed.steps_table, Path)  # nothing read back yet
    assert streamed.summary == mem.summary
    names = ("time", "used_blocks", "admitted_hit_tokens")
    pd.testing.assert_frame_equal(streamed.step_columns(*names), mem.steps[list(names)])
    pd.testing.assert_frame_equal(streamed.steps, mem.steps)
    # the run folder copies the file in and the result reads it from there
    streamed = simulate(wl, cfg, steps_file=tmp_path / "t.parquet")
    out = write_run(streamed, tmp_path / "run", plots=False)
    assert streamed.steps_table == out / "steps.parquet"
    pd.testing.assert_frame_equal(load_run(out).steps, mem.steps)


def test_a_given_segment_sets_the_row_groups_and_packs_a_quarter_of_it_at_a_time(tmp_path: Path) -> None:
    """A cluster's replicas stream in small row groups (`segment`): 20 rows, segments of 8 packed
    2 rows at a time, are 3 row groups (8 + 8 + 4), the same table as in memory."""
    log = StepLog(tmp_path / "steps.parquet", segment=8)
    assert (log.segment, log.chunk) == (8, 2)
    assert (StepLog().segment, StepLog().chunk) == (65_536, 4096)
    for r in rows(20):
        log.record(r)
    mem = SmallLog()
    for r in rows(20):
        mem.record(r)
    pd.testing.assert_frame_equal(log.frame(), mem.frame())
    meta = pq.ParquetFile(log.path).metadata
    assert [meta.row_group(g).num_rows for g in range(meta.num_row_groups)] == [8, 8, 4]
