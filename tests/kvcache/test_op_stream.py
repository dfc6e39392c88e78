"""The op log in chunks: late writes put in step order, streamed files read back whole."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsim.kvcache.ops import Op, OpLog, read_op_rows, read_ops, read_tokens


def _late_example(log: OpLog) -> None:
    """Steps 5..8; seq "x" decodes lazily in block 7 from step 5 (slot 2) and is recorded at step 8."""
    log.lag = 4
    for step in range(5, 9):
        log.set_step(step)
        log.emit("write", 3, 0, 4, "y", pos=4 * step)
        if step == 6:
            log.emit("evict", 9, h=2**64 - 1)
    log.late_writes("x", 7, 5, 3, 2, 18)
    log.emit("free", 3)


def test_late_writes_go_to_the_end_of_their_steps() -> None:
    log = OpLog(enabled=True)
    _late_example(log)
    assert log.records() == [
        Op(5, "write", 3, 0, 4, "y", pos=20), Op(5, "write", 7, 2, 3, "x", pos=18),
        Op(6, "write", 3, 0, 4, "y", pos=24), Op(6, "evict", 9, hash=2**64 - 1), Op(6, "write", 7, 3, 4, "x", pos=19),
        Op(7, "write", 3, 0, 4, "y", pos=28), Op(7, "write", 7, 4, 5, "x", pos=20),
        Op(8, "write", 3, 0, 4, "y", pos=32), Op(8, "free", 3),
    ]
    assert len(log) == 9 and log.counts["write"] == 4  # late writes are counted by the caller


def test_a_chunk_holds_back_rows_a_late_write_may_still_precede(tmp_path) -> None:
    log = OpLog(enabled=True, chunk_rows=1)
    log.stream_to(tmp_path)
    _late_example(log)
    # stepping to 8 cut the rows of steps before 8 - lag = 4: none yet
    assert log._done == 0
    log.set_step(10)  # rows before step 6 are final now; x's late run is split at the cut
    assert log._done == 2
    log.keep_tokens("x", np.arange(3))
    log.keep_tokens("x", np.arange(5))  # released twice: the last counts
    log.save(tmp_path)
    assert pq.ParquetFile(tmp_path / "ops.parquet").metadata.num_row_groups == 2
    memory = OpLog(enabled=True)
    _late_example(memory)
    assert read_ops(tmp_path / "ops.parquet") == memory.records()
    assert read_tokens(tmp_path / "op_tokens.parquet")["x"].tolist() == [0, 1, 2, 3, 4]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    chunk=st.integers(1, 12),
    lag=st.integers(1, 5),
    steps=st.lists(st.tuples(st.integers(0, 6), st.lists(st.integers(0, 4), max_size=3)), min_size=1, max_size=25),
)
def test_streamed_chunks_equal_one_sort_by_step(tmp_path_factory, chunk: int, lag: int, steps) -> None:
    """Any mix of ops (a decode's new block as one run of rows too) and late writes (at most `lag`
    steps late), cut into chunks of any size:
    the file holds every row once, stably ordered by step, a late write after its step's rows."""
    folder = tmp_path_factory.mktemp("ops")
    logs = [OpLog(enabled=True, chunk_rows=chunk), OpLog(enabled=True)]
    logs[0].stream_to(folder)
    expect: list[tuple[int, int, Op]] = []  # (step, late, op) in emission order
    for log in logs:
        log.lag = lag
    for k, (n_ops, lates) in enumerate(steps):
        for log in logs:
            log.set_step(k)
        for i in range(n_ops):
            kind = ("write", "table", "free", "evict", "edge", "edge")[i]
            h = (2**63 + k * 10 + i) if kind == "evict" or (kind == "edge" and i == 5) else None
            if kind == "edge":  # a decode's new block (one run): [its eviction,] its entry, its write
                for log in logs:
                    log.record_edge(f"s{i}", k * 10 + i, i, 16 * i + 3, 16, h)
                rows = [Op(k, "evict", k * 10 + i, -1, -1, "", h, -1)] if h is not None else []
                rows += [Op(k, "table", k * 10 + i, i, -1, f"s{i}", None, -1),
                         Op(k, "write", k * 10 + i, 3, 4, f"s{i}", None, 16 * i + 3)]
                expect += [(k, 0, op) for op in rows]
                continue
            for log in logs:
                log.emit(kind, k * 10 + i, i, seq=f"s{i}", h=h)
            expect.append((k, 0, Op(k, kind, k * 10 + i, i, -1, f"s{i}", h, -1)))
        for j, back in enumerate(lates):
            first = max(k - min(back, lag), 0)
            n = k - first
            if n:
                for log in logs:
                    log.late_writes(f"z{j}", 100 + j, first, n, 1, 40)
                expect += [(first + d, 1, Op(first + d, "write", 100 + j, 1 + d, 2 + d, f"z{j}", None, 40 + d))
                           for d in range(n)]
        for log in logs:
            log.keep_tokens(f"t{k}", np.arange(k))
    want = [op for _, _, op in sorted(expect, key=lambda e: e[0])]  # stable: late after within a step
    assert logs[1].records() == want
    logs[0].save(folder)
    assert read_ops(folder / "ops.parquet") == want
    tokens = read_tokens(folder / "op_tokens.parquet")
    assert {s: t.tolist() for s, t in tokens.items()} == {f"t{k}": list(range(k)) for k in range(len(steps))}
    with pytest.raises(ValueError, match="streams to"):
        logs[0].records()


def test_read_op_rows_are_read_ops_as_tuples(tmp_path):
    log = OpLog(True)
    log.emit("table", 3, 0, seq="a")
    log.emit("write", 3, 0, 4, "a", pos=0)
    log.step = 1
    log.emit("evict", 5, h=2**63 + 7)
    log.emit("copy", 3, 4)
    log.to_parquet(tmp_path / "ops.parquet")
    rows = read_op_rows(tmp_path / "ops.parquet")
    assert rows == [(o.step, o.kind, o.a, o.b, o.c, o.seq, o.hash, o.pos, o.group)
                    for o in read_ops(tmp_path / "ops.parquet")]
    assert rows[1] == (0, "write", 3, 0, 4, "a", None, 0, 0) and rows[2] == (1, "evict", 5, -1, -1, "", 2**63 + 7, -1, 0)
    assert rows[0][5] is rows[1][5]  # one string per name


def test_every_row_carries_its_group(tmp_path) -> None:
    """Runs, single ops and late writes keep their group; a free or evict takes its block's group
    from `group_of` (split into one run a stretch of one group), and the file reads back the same."""
    log = OpLog(True)
    log.group_of = [0, 1, 1, 0, 2]
    log.lag = 2
    log.set_step(1)
    log.emit_table("a", [type("B", (), {"block_id": i})() for i in (1, 2)], 0, 2, group=1)
    log.emit_span("a", [1, 2], 0, 6, 4, group=1)
    log.emit_entry("a", 4, 0, group=2)
    log.emit_write("a", 4, 5, 4, group=2)
    log.late_writes("b", 3, 0, 2, 1, 9, group=2)
    log.emit_free([1, 2, 3, 4])
    log.emit_evicts([4, 1], [7, 8])
    log.emit("evict", 3, h=9)
    want = [
        Op(0, "write", 3, 1, 2, "b", pos=9, group=2),
        Op(1, "table", 1, 0, seq="a", group=1), Op(1, "table", 2, 1, seq="a", group=1),
        Op(1, "write", 1, 0, 4, "a", pos=0, group=1), Op(1, "write", 2, 0, 2, "a", pos=4, group=1),
        Op(1, "table", 4, 0, seq="a", group=2), Op(1, "write", 4, 1, 2, "a", pos=5, group=2),
        Op(1, "free", 1, group=1), Op(1, "free", 2, group=1), Op(1, "free", 3, group=0), Op(1, "free", 4, group=2),
        Op(1, "evict", 4, hash=7, group=2), Op(1, "evict", 1, hash=8, group=1), Op(1, "evict", 3, hash=9, group=0),
        Op(1, "write", 3, 2, 3, "b", pos=10, group=2),
    ]
    assert log.records() == want
    log.to_parquet(tmp_path / "ops.parquet")
    assert read_ops(tmp_path / "ops.parquet") == want


@pytest.mark.parametrize("how", ["memory", "thread", "process"])
def test_token_ids_are_delta_encoded_on_every_path(tmp_path, how: str) -> None:
    """`op_tokens.parquet`'s ids are written DELTA_BINARY_PACKED however the log is saved: a synthetic
    prompt's ids run in steps of one, so 10,000 of them take a few hundred bytes, not 80,000."""
    log = OpLog(enabled=True)
    if how != "memory":
        log.stream_to(tmp_path, process=how == "process")
    log.keep_tokens("x", np.arange(10_000))
    log.keep_tokens("y", np.arange(-7, 0))
    log.save(tmp_path)
    column = pq.ParquetFile(tmp_path / "op_tokens.parquet").metadata.row_group(0).column(1)
    assert column.path_in_schema == "tokens.list.element"
    assert "DELTA_BINARY_PACKED" in column.encodings
    assert column.total_compressed_size < 2_000
    tokens = read_tokens(tmp_path / "op_tokens.parquet")
    assert tokens["x"].tolist() == list(range(10_000)) and tokens["y"].tolist() == list(range(-7, 0))


def test_a_child_writer_holds_chunks_in_flight_and_raises_its_error(tmp_path) -> None:
    """The child writer takes up to IN_FLIGHT chunks before the simulation waits for a reply; a chunk
    it cannot write (here not a table) is raised in the simulation, naming the folder, at the send
    that finds the child gone or at close, whichever comes first, never swallowed."""
    from kvsim.kvcache import op_writer

    good = OpLog(enabled=True)
    good.emit("free", 3)
    table = good._all()
    sink = op_writer.Sink(tmp_path, process=True)
    for _ in range(op_writer.IN_FLIGHT):
        sink.write("ops", table)
    assert sink._awaiting == op_writer.IN_FLIGHT  # none waited for
    sink.write("ops", "not a table")  # waits for the oldest reply only
    assert sink._awaiting == op_writer.IN_FLIGHT
    with pytest.raises(RuntimeError, match=f"(?s)op log writer for {re.escape(str(tmp_path))} failed: "
                                           ".*'str' object has no attribute"):
        for _ in range(100):  # the sends that follow find it gone, or close reads its error
            sink.write("ops", table)
        sink.close()


def test_a_child_writer_writes_every_chunk_in_order(tmp_path) -> None:
    """Many chunks through the child, IN_FLIGHT at a time: the file holds them all, in order."""
    from kvsim.kvcache import op_writer

    sink = op_writer.Sink(tmp_path, process=True)
    for i in range(3 * op_writer.IN_FLIGHT + 1):
        log = OpLog(enabled=True)
        log.set_step(i)
        log.emit("free", i)
        sink.write("ops", log._all())
    sink.close()
    assert [(op.step, op.a) for op in read_ops(tmp_path / "ops.parquet")] == [(i, i) for i in range(13)]


@pytest.mark.parametrize("key", [None, 2**64 - 5])
def test_a_new_decode_block_is_one_run_of_the_three_rows(key) -> None:
    """Hand-worked: `record_edge` (a decode token's new block 9, entry 4 of `s`, position 66 of
    blocks of 16 slots) gives the rows of `emit_evicts`, `emit_entry` and `emit_write`, and counts
    nothing (its caller counts them)."""
    one, three = OpLog(enabled=True), OpLog(enabled=True)
    for log in (one, three):
        log.set_step(5)
        log.emit("free", 1)
    one.record_edge("s", 9, 4, 66, 16, key)
    if key is not None:
        three.emit_evicts([9], [key])
    three.emit_entry("s", 9, 4)
    three.emit_write("s", 9, 66, 16)
    want = [Op(5, "free", 1, -1, -1, "", None, -1, 0)] + \
        ([Op(5, "evict", 9, -1, -1, "", key, -1, 0)] if key is not None else []) + \
        [Op(5, "table", 9, 4, -1, "s", None, -1, 0), Op(5, "write", 9, 2, 3, "s", None, 66, 0)]
    assert one.records() == three.records() == want
    assert three.counts - one.counts == Counter(table=1, write=1, evict=int(key is not None))


def test_packed_chunk_ints_keep_every_value() -> None:
    """Hand-worked: a chunk's ints go to the writer as int32 where every one fits, else as int64;
    block keys as unsigned 64-bit, else as they are (a key past 64 bits is not silently cut)."""
    from kvsim.kvcache.op_files import pack_hashes, pack_ints

    small = pack_ints([0, -1, 2**31 - 1])
    assert small.dtype == np.int32 and small.tolist() == [0, -1, 2**31 - 1]
    big = pack_ints([0, 2**31, -(2**40)])
    assert big.dtype == np.int64 and big.tolist() == [0, 2**31, -(2**40)]
    assert list(pack_hashes([0, 2**64 - 1])) == [0, 2**64 - 1]
    assert pack_hashes([2**64, 1]) == [2**64, 1]
