"""The op stream: typed records, versioned JSON Lines and parquet."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsim.kvcache.manager import KVCacheManager
from kvsim.kvcache.op_files import token_ids, tokens_table
from kvsim.kvcache.ops import OPS_VERSION, Op, read_ops, read_tokens
from tests.kvcache.conftest import prefill, seq


def _ops():
    m = KVCacheManager(8, 4, record_ops=True, num_cpu_blocks=2)
    a = seq("a", range(6))
    m.ops.step = 3
    prefill(m, a)
    m.swap_out([a])
    return m.ops


def test_records_are_typed_and_ordered():
    ops = _ops()
    assert ops.records() == [
        Op(3, "table", 1, 0, seq="a"),
        Op(3, "table", 2, 1, seq="a"),
        Op(3, "write", 1, 0, 4, "a", pos=0),
        Op(3, "write", 2, 0, 2, "a", pos=4),
        Op(3, "swap_out", 1, 0, -1, "a"),
        Op(3, "swap_out", 2, 1, -1, "a"),
        Op(3, "free", 2),
        Op(3, "free", 1),
    ]
    assert dict(ops.counts) == {"table": 2, "write": 2, "swap_out": 2, "free": 2}


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_round_trip(tmp_path, suffix):
    ops = _ops()
    path = tmp_path / f"ops{suffix}"
    (ops.to_jsonl if suffix == ".jsonl" else ops.to_parquet)(path)
    assert read_ops(path) == ops.records()


def test_save_writes_ops_and_tokens(tmp_path):
    ops = _ops()
    ops.save(tmp_path)
    assert read_ops(tmp_path / "ops.parquet") == ops.records()
    tokens = read_tokens(tmp_path / "op_tokens.parquet")
    assert tokens["a"].tolist() == [0, 1, 2, 3, 4, 5, -(1 + 6)]


def test_version_mismatch_is_refused(tmp_path):
    path = tmp_path / "ops.jsonl"
    path.write_text(json.dumps({"kvsim_ops": OPS_VERSION + 1}) + "\n")
    with pytest.raises(ValueError, match=f"op stream version {OPS_VERSION + 1}"):
        read_ops(path)


def test_a_stream_before_the_group_column_is_refused(tmp_path):
    """A version 1 file (no `group` column) is refused with its path, not read as group 0."""
    import pyarrow.parquet as pq

    path = tmp_path / "ops.parquet"
    _ops().to_parquet(path)
    table = pq.read_table(path)
    pq.write_table(table.drop(["group"]).replace_schema_metadata({"kvsim_ops": "1"}), path)
    with pytest.raises(ValueError) as e:
        read_ops(path)
    assert str(e.value) == f"{path}: op stream version 1, this kvsim reads version 2; record it again with this kvsim"


def test_disabled_log_counts_without_records():
    m = KVCacheManager(8, 4)
    prefill(m, seq("a", range(6)))
    assert len(m.ops) == 0 and m.ops.counts["write"] == 2


def test_token_ids_cover_known_and_unique_positions():
    s = seq("a", [5, 6, 7], uid=2, output=[8])
    assert s.token_ids(1, 6).tolist() == [6, 7, 8, -(1 + (2 << 24 | 4)), -(1 + (2 << 24 | 5))]


def test_a_fork_shares_the_tokens_decoded_before_it():
    parent = seq("p", [5, 6], uid=1, output=[7])
    parent.append_tokens(2)  # positions 2 (known: 7) and 3 (unique, parent's)
    child = parent.fork("c", uid=9)
    child.append_tokens(1)  # position 4: the child's own
    assert child.token_ids(0, 5).tolist() == [5, 6, 7, -(1 + (1 << 24 | 3)), -(1 + (9 << 24 | 4))]
    assert parent.token_ids(0, 4).tolist() == child.token_ids(0, 4).tolist()


def test_transfers_at_the_step_start_go_ahead_of_the_step_s_ops(tmp_path):
    """A finished request's store, decided after the step reused its blocks, is recorded ahead of the
    step's ops (sim.engine.offload: the worker copies it before the forward); later ones keep their order."""
    m = KVCacheManager(8, 4, record_ops=True)
    m.set_step(0)
    prefill(m, seq("a", range(6)))
    m.set_step(1)
    m.free(seq("a", range(6)))
    m.ops.emit_transfers("store", [(1, 0)], "x")
    m.ops.emit_transfers("store", [(2, 5), (1, 6)], "b", at_start=True)
    m.ops.emit_transfers("load", [(5, 3)], "c", at_start=True)
    ops = m.ops.records()
    assert [(o.step, o.kind, o.a, o.b, o.seq) for o in ops[4:]] == [
        (1, "store", 2, 5, "b"), (1, "store", 1, 6, "b"), (1, "load", 5, 3, "c"),
        (1, "free", 2, -1, ""), (1, "free", 1, -1, ""), (1, "store", 1, 0, "x"),
    ]
    assert (m.ops.counts["store"], m.ops.counts["load"]) == (3, 1)
    m.ops.save(tmp_path)
    assert read_ops(tmp_path / "ops.parquet") == ops


@pytest.mark.parametrize("chunk_rows", [None, 1])
def test_a_late_write_goes_where_its_steps_last_schedule_ends(tmp_path, chunk_rows):
    """Under async output a step's ops come in two runs: its schedule's, then, after the next step's
    schedule, its output's. A lazy decode's writes, recorded steps later, go at the end of their
    step's last schedule (an empty schedule of step 1 precedes its real one), ahead of the output of
    the step before; rows otherwise keep the order they were emitted in (sim.engine.loop's async
    output, sim.engine.shortcuts.AsyncLazy). Streamed a row a chunk, the files hold the same."""
    from kvsim.kvcache.ops import OpLog

    for streamed in (False, True):
        log = OpLog(enabled=True, chunk_rows=chunk_rows)
        log.lag = 4
        if streamed:
            log.stream_to(tmp_path)
        log.set_step(0)
        log.emit("free", 1)  # step 0's schedule
        log.set_step(1)  # step 1's schedule, empty: the batch runs no forward
        log.set_step(0, output=True)
        log.emit("free", 2)  # step 0's output
        log.set_step(1)  # step 1's schedule again, with a forward
        log.emit("free", 3)
        log.set_step(2)
        log.emit("free", 4)
        log.set_step(1, output=True)
        log.emit("free", 5)
        log.late_writes("s", 7, 1, 2, 3, 19)  # writes at steps 1 and 2, slots 3 and 4, positions 19 and 20
        for step in range(3, 9):
            log.set_step(step)
        if streamed:
            log.finish()
            log.save(tmp_path)
            ops = read_ops(tmp_path / "ops.parquet")
        else:
            ops = log.records()
        assert [(o.step, o.kind, o.a, o.b, o.pos) for o in ops] == [
            (0, "free", 1, -1, -1), (0, "free", 2, -1, -1), (1, "free", 3, -1, -1), (1, "write", 7, 3, 19),
            (2, "free", 4, -1, -1), (2, "write", 7, 4, 20), (1, "free", 5, -1, -1),
        ]


def test_a_forks_ids_run_by_its_lineage():
    """Hand-worked: a parent (uid 2) with prompt [5, 6] and known output [8] decodes 2 tokens (positions
    3, 4 unique under uid 2); a fork (uid 7) at 5 tokens decodes 2 more (positions 5, 6 under uid 7)."""
    parent = seq("p", [5, 6], uid=2, output=[8])
    parent.append_tokens(3)
    child = parent.fork("c", uid=7)
    child.append_tokens(2)
    u = [-(1 + (2 << 24 | 3)), -(1 + (2 << 24 | 4)), -(1 + (7 << 24 | 5)), -(1 + (7 << 24 | 6))]
    assert child.token_ids(0, 7).tolist() == [5, 6, 8, *u]
    assert child.token_ids(4, 6).tolist() == u[1:3]


@settings(max_examples=80, deadline=None, derandomize=True)
@given(prompt=st.integers(1, 40), output=st.integers(0, 20), decodes=st.lists(st.integers(0, 30), min_size=1, max_size=4),
       cut=st.integers(0, 200))
def test_token_parts_filled_are_the_token_ids(prompt: int, output: int, decodes: list[int], cut: int):
    """What the op log's writer gets for a sequence (`token_parts`, known ids in their own dtype and
    its lineage) fills in to exactly `token_ids(0, n)`, for any n and any chain of forks; and every
    window of `token_ids` is that window of the whole."""
    s = seq("s", range(100, 100 + prompt), uid=1, output=range(500, 500 + output))
    for i, d in enumerate(decodes):
        s.append_tokens(d)
        if i + 1 < len(decodes):
            s = s.fork(f"f{i}", uid=10 + i)
    n = s.num_tokens
    whole = s.token_ids(0, n)
    for m in (n, min(cut, n)):
        assert token_ids(s.token_parts(m), m).tolist() == whole[:m].tolist()
        assert tokens_table([("s", s, m)]).column("tokens")[0].as_py() == whole[:m].tolist()
    lo = min(cut, n)
    assert s.token_ids(lo, n).tolist() == whole[lo:].tolist()


@settings(max_examples=80, deadline=None, derandomize=True)
@given(ids=st.one_of(st.tuples(st.integers(0, 2**31 - 300), st.integers(1, 200)).map(lambda t: list(range(t[0], t[0] + t[1]))),
                     st.lists(st.integers(0, 50), min_size=1, max_size=40)),
       decoded=st.integers(0, 20))
def test_known_ids_in_steps_of_one_go_as_a_range(ids: list[int], decoded: int):
    """`token_parts` sends known ids that run first, first + 1, ... (a trace's fresh prompt) as a
    `range`, any others as their array, and either fills in to exactly `token_ids`."""
    s = seq("s", np.array(ids, np.int32), uid=3)
    s.append_tokens(decoded)
    n = s.num_tokens
    parts = s.token_parts(n)
    steps_of_one = len(ids) > 1 and ids == list(range(ids[0], ids[0] + len(ids)))
    assert (type(parts.known) is range) == steps_of_one
    assert list(parts.known) == ids
    assert token_ids(parts, n).tolist() == s.token_ids(0, n).tolist()


def test_a_range_of_ids_pickles_in_a_few_bytes():
    """Hand-worked: 100,000 fresh prompt ids go to the op writer's child as one range, not 400 KB."""
    import pickle

    s = seq("s", np.arange(7, 100_007, dtype=np.int32))
    parts = s.token_parts(100_000)
    assert parts.known == range(7, 100_007)
    assert len(pickle.dumps(parts)) < 200
    assert seq("t", np.array([7, 9, 8, 10], np.int32)).token_parts(4).known.tolist() == [7, 9, 8, 10]
