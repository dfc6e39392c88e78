"""Injected faults of every kind are caught by the replay and attributed to the fault that made them."""

from collections import Counter
from dataclasses import astuple, replace
from types import SimpleNamespace

import gpu_scenarios as scenarios
import pytest
from gpu_env import DEVICE

from kvsim.gpu.executor import ONE_WAY, SKIPPED
from kvsim.gpu.faults import FAULT_KINDS, Fault, attribute, format_faults, inject_faults
from kvsim.gpu.replay import load_run, replay_ops
from kvsim.gpu.verify import Mismatch


@pytest.fixture(scope="module")
def every(tmp_path_factory):
    return load_run(scenarios.every_kind(tmp_path_factory.mktemp("every")))


@pytest.fixture(scope="module")
def lifecycle(tmp_path_factory):
    return load_run(scenarios.lifecycle(tmp_path_factory.mktemp("lifecycle"))[0])


def _inject(run, n, seed, kinds=FAULT_KINDS):
    ops, tokens, config = run
    return inject_faults(ops, n, seed, kinds, tokens=tokens, block_size=config["block_size"])


def _replay(run, ops):
    _, tokens, config = run
    return replay_ops(ops, tokens, config, DEVICE, layers=1, kv_heads=1, head_dim=4, strict=False)


def test_clean_replay_has_no_mismatches(every):
    ops = every[0]
    assert set(Counter(op.kind for op in ops)) == {"write", "table", "free", "evict", "copy", "swap_out", "swap_in",
                                                   "move"}
    rep = _replay(every, ops)
    assert rep.mismatches == 0 and rep.found == []
    assert attribute([], rep) == []


def _changed(ops, bad):
    return [i for i, (a, b) in enumerate(zip(ops, bad, strict=True)) if a != b]


@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_each_kind_is_caught(every, kind):
    ops = every[0]
    bad, faults = _inject(every, 1, 0, (kind,))
    (f,) = faults
    assert f.kind == kind and f.step == ops[f.index].step <= f.until and f.blocks
    was, now = ops[f.index], bad[f.index]
    changed = _changed(ops, bad)
    if kind == "reused_while_referenced":  # the table op and the sequence's later ops on the block
        assert changed[0] == f.index and now.kind == "table" and now.a != was.a
        assert all(bad[i].seq == was.seq and (ops[i].a, bad[i].a) == (was.a, now.a) for i in changed)
    else:
        assert changed == [f.index]
        expected = {"copy_dropped": replace(was, c=SKIPPED), "move_dropped": replace(was, c=SKIPPED),
                    "move_reversed": replace(was, c=ONE_WAY)}.get(kind)
        if expected is not None:
            assert now == expected
        elif kind == "swap_in_wrong":
            assert now == replace(was, a=now.a) and now.a != was.a
        else:
            assert now.kind == "write" and now.c - now.b == was.c - was.b and (now.a, now.b) != (was.a, was.b)
    rep = _replay(every, bad)
    assert rep.mismatches > 0
    assert attribute(faults, rep) == [True]
    # as the shadow replay predicted: the first mismatches in step `until`, naming `blocks` there
    assert min(m.step for m in rep.found) == f.until
    assert set().union(*(m.blocks for m in rep.found if m.step == f.until)) == set(f.blocks)


def test_dropped_copy_on_lifecycle(lifecycle):
    bad, faults = _inject(lifecycle, 1, 0, ("copy_dropped",))
    assert faults == [Fault("copy_dropped", 19, 1, 1, (9,), "copy-on-write copy of block 8 to block 9 not run")]
    rep = _replay(lifecycle, bad)
    assert rep.mismatches == 10  # positions 8 and 9 of A, read back in each of steps 1 to 5 (test_faults.py)
    assert [(m.step, m.seq, m.position, m.blocks) for m in rep.found] == [(s, "A", 8, (9,)) for s in range(1, 6)]
    assert attribute(faults, rep) == [True]


def test_same_seed_same_faults(every):
    ops = every[0]
    kept = list(ops)
    first = _inject(every, 4, 7)
    assert _inject(every, 4, 7) == first
    assert ops == kept  # the stream given is not changed
    assert _inject(every, 4, 8)[1] != first[1]
    rows = [astuple(op) for op in ops]  # the replay's row form is taken too
    assert _inject((rows, *every[1:]), 4, 7) == first


def test_n_faults_all_caught(every):
    bad, faults = _inject(every, 6, 1)
    assert len(faults) == 6
    assert {f.kind for f in faults} == set(FAULT_KINDS)
    assert [f.index for f in faults] == sorted(f.index for f in faults)
    assert len({f.step for f in faults}) == 6
    blocks = [b for f in faults for b in f.blocks]
    assert len(blocks) == len(set(blocks))
    rep = _replay(every, bad)
    assert attribute(faults, rep) == [True] * 6


def test_a_kind_without_candidates_is_named(tmp_path):
    run = load_run(scenarios.concurrent(tmp_path))  # prefix hits and evictions only: no copy, swap or move
    with pytest.raises(ValueError, match=r"^cannot inject 1 fault: no fault of the kinds asked for would be caught "
                                         r"in this stream; move_dropped: no move ops: run with --defrag-threshold$"):
        _inject(run, 1, 0, ("move_dropped",))
    with pytest.raises(ValueError, match=r"; copy_dropped: no copy ops: copy-on-write needs forked sequences .*; "
                                         r"swap_in_wrong: no swap_in op .*--preemption swap"):
        _inject(run, 1, 0, ("copy_dropped", "swap_in_wrong"))
    _, faults = _inject(run, 2, 0)  # the kinds that have candidates are used
    assert {f.kind for f in faults} <= {"write_misplaced", "reused_while_referenced"}


def test_more_faults_than_candidates(lifecycle):
    with pytest.raises(ValueError, match=r"^cannot inject 50 faults: only \d caught and unambiguous in this stream "
                                         r"\(copy_dropped 1, .*\)$"):
        _inject(lifecycle, 50, 0)


@pytest.mark.parametrize("n,kinds,message", [
    (0, FAULT_KINDS, "the number of faults must be >= 1, got 0"),
    (1, ("copy",), "unknown fault kind 'copy'; choose from copy_dropped, move_reversed"),
    (1, (), "unknown fault kind ''"),
])
def test_bad_arguments(lifecycle, n, kinds, message):
    with pytest.raises(ValueError, match="^" + message):
        _inject(lifecycle, n, 0, kinds)


def test_a_sequence_without_tokens_is_named(lifecycle):
    ops, tokens, config = lifecycle
    tokens = {s: t for s, t in tokens.items() if s != "A/1"}
    with pytest.raises(ValueError, match=r"^op_tokens.parquet: no tokens for sequence 'A/1'$"):
        inject_faults(ops, 1, 0, ("copy_dropped",), tokens=tokens, block_size=config["block_size"])


def test_attribution_needs_a_mismatch_on_its_blocks_in_its_steps():
    f = Fault("move_dropped", 40, 5, 6, (3, 7), "defrag move 3 <-> 7 not run")

    def report(*found):
        return SimpleNamespace(found=[Mismatch(step, "s", 0, "K", blocks=blocks) for step, blocks in found])

    assert attribute([f], report()) == [False]
    assert attribute([f], report((4, (3,)), (5, (4,)), (7, (7,)))) == [False]  # too early; other blocks; too late
    assert attribute([f], report((4, (3,)), (6, (2, 7)))) == [True]


def test_format_faults():
    faults = [Fault("copy_dropped", 19, 1, 1, (9,), "copy-on-write copy of block 8 to block 9 not run"),
              Fault("move_dropped", 57, 6, 7, (2, 13), "defrag move 13 <-> 2 not run")]
    assert format_faults(faults, [True, False]).splitlines() == [
        "  # kind                           op         steps  blocks                   what",
        "  1 copy_dropped                   19          1..1  9                caught  copy-on-write copy of block 8 "
        "to block 9 not run",
        "  2 move_dropped                   57          6..7  2,13             MISSED  defrag move 13 <-> 2 not run",
        "caught 1 of 2 injected faults",
    ]
    assert format_faults(faults).splitlines()[1].endswith("9                        copy-on-write copy of block 8 "
                                                          "to block 9 not run")
