"""The hybrid manager's op stream: every group's table entries, writes, frees and evictions, each
with its group (`kvcache.hybrid`, `kvcache.ops`), hand-worked."""

from __future__ import annotations

from kvsim.kvcache.groups import GroupSpec
from kvsim.kvcache.hybrid import HybridKVCacheManager
from kvsim.kvcache.ops import Op
from tests.kvcache.conftest import decode, prefill, seq


def _table(step, block, entry, sid, group):
    return Op(step, "table", block, entry, seq=sid, group=group)


def _write(step, block, first, end, sid, pos, group):
    return Op(step, "write", block, first, end, sid, pos=pos, group=group)


def test_a_window_moving_past_blocks_a_hit_and_a_free() -> None:
    """Full attention (group 0) and a window of 8 (group 1), blocks of 4: a's prefill takes blocks
    1-3 and 4-6; its decodes of positions 10-12 move the window past its block 0 (the entry turns
    null, then block 4 is freed in group 1); b hits a's first 8 tokens in both groups (block 4,
    freed but cached, is taken back); a's free goes group by group, each table's tail first."""
    m = HybridKVCacheManager(12, [GroupSpec("full", 4), GroupSpec("sliding_window", 4, 8)], record_ops=True)
    a, b = seq("a", range(10)), seq("b", [*range(8), 50, 51])
    m.ops.step = 1
    prefill(m, a)
    m.ops.step = 2
    for _ in range(3):
        decode(m, a)
    m.ops.step = 3
    assert prefill(m, b)[0] == 8
    m.ops.step = 4
    m.free(a)
    assert m.ops.records() == [
        _table(1, 1, 0, "a", 0), _table(1, 2, 1, "a", 0), _table(1, 3, 2, "a", 0),
        _write(1, 1, 0, 4, "a", 0, 0), _write(1, 2, 0, 4, "a", 4, 0), _write(1, 3, 0, 2, "a", 8, 0),
        _table(1, 4, 0, "a", 1), _table(1, 5, 1, "a", 1), _table(1, 6, 2, "a", 1),
        _write(1, 4, 0, 4, "a", 0, 1), _write(1, 5, 0, 4, "a", 4, 1), _write(1, 6, 0, 2, "a", 8, 1),
        _write(2, 3, 2, 3, "a", 10, 0), _write(2, 6, 2, 3, "a", 10, 1),
        _table(2, 0, 0, "a", 1), Op(2, "free", 4, group=1),  # position 11's window no longer reads block 0
        _write(2, 3, 3, 4, "a", 11, 0), _write(2, 6, 3, 4, "a", 11, 1),
        _table(2, 7, 3, "a", 0), _write(2, 7, 0, 1, "a", 12, 0), _table(2, 8, 3, "a", 1), _write(2, 8, 0, 1, "a", 12, 1),
        _table(3, 1, 0, "b", 0), _table(3, 2, 1, "b", 0), _table(3, 9, 2, "b", 0), _write(3, 9, 0, 2, "b", 8, 0),
        _table(3, 4, 0, "b", 1), _table(3, 5, 1, "b", 1), _table(3, 10, 2, "b", 1), _write(3, 10, 0, 2, "b", 8, 1),
        Op(4, "free", 7, group=0), Op(4, "free", 3, group=0), Op(4, "free", 8, group=1), Op(4, "free", 6, group=1),
    ]
    assert dict(m.ops.counts) == {"table": 15, "write": 7, "free": 5}  # writes counted as one group's
    assert m.ops.tokens["a"].tolist()[:10] == list(range(10))


def test_a_mamba_group_writes_its_state_block() -> None:
    """A Mamba group (group 1) keeps one running state block: a's prefill of 10 tokens takes block 4
    at entry 2 (nulls before it) and writes the state after 10 tokens (position 9); each decode
    rewrites it; the decode of position 12 starts a new state block, the old one kept until the
    next allocation (vLLM's align mode), so a's free returns both, tail first."""
    m = HybridKVCacheManager(12, [GroupSpec("full", 4), GroupSpec("mamba", 4)], record_ops=True)
    a = seq("a", range(10))
    for step in range(1, 5):
        m.ops.step = step
        m.new_step_starts()
        prefill(m, a) if step == 1 else decode(m, a)
    m.ops.step = 5
    m.free(a)
    assert [op for op in m.ops.records() if op.group == 1] == [
        _table(1, 0, 0, "a", 1), _table(1, 0, 1, "a", 1), _table(1, 4, 2, "a", 1), _write(1, 4, 1, 2, "a", 9, 1),
        _write(2, 4, 2, 3, "a", 10, 1), _write(3, 4, 3, 4, "a", 11, 1),
        _table(4, 6, 3, "a", 1), _write(4, 6, 0, 1, "a", 12, 1),
        Op(5, "free", 6, group=1), Op(5, "free", 4, group=1),
    ]
    assert [(op.step, op.kind, op.a) for op in m.ops.records() if op.group == 0 and op.kind != "table"] == [
        (1, "write", 1), (1, "write", 2), (1, "write", 3), (2, "write", 3), (3, "write", 3), (4, "write", 5),
        (5, "free", 5), (5, "free", 3), (5, "free", 2), (5, "free", 1)]


def test_evictions_carry_the_group_that_held_the_block() -> None:
    """a's blocks go back cached (each group's tail first), then b's allocation takes the free queue
    in order, evicting as it goes: each evict names the group that cached the block, and block 1,
    group 0's before, is now group 1's entry 0 (one pool, one group holding a block at a time)."""
    m = HybridKVCacheManager(7, [GroupSpec("full", 4), GroupSpec("sliding_window", 4, 8)], record_ops=True)
    a, b = seq("a", range(9)), seq("b", range(100, 109))
    prefill(m, a)
    m.free(a)
    prefill(m, b)
    ops = m.ops.records()
    assert [(op.a, op.group) for op in ops if op.kind == "free"] == [(3, 0), (2, 0), (1, 0), (6, 1), (5, 1), (4, 1)]
    assert [(op.a, op.group) for op in ops if op.kind == "evict"] == [(2, 0), (1, 0), (5, 1), (4, 1)]
    assert [(op.a, op.b, op.group) for op in ops if op.kind == "table" and op.seq == "b"] == [
        (6, 0, 0), (3, 1, 0), (2, 2, 0), (1, 0, 1), (5, 1, 1), (4, 2, 1)]
