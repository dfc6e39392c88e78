"""Wrong op streams are caught, with the step, sequence, position and block named."""

import re
from dataclasses import replace

import gpu_scenarios as scenarios
import pytest
from gpu_env import DEVICE

from kvsim.gpu.checks import CHECKS
from kvsim.gpu.replay import load_run, replay_ops
from kvsim.gpu.verify import IntegrityError


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder, _ = scenarios.lifecycle(tmp_path_factory.mktemp("faults"))
    return load_run(folder)


@pytest.fixture(params=CHECKS)
def check(request):
    return request.param


def _replay(run, ops, check="full", **kw):
    _, tokens, config = run
    return replay_ops(ops, tokens, config, DEVICE, layers=1, check=check, **kw)


def _without(ops, kind, a, b=-1):
    (i,) = [i for i, op in enumerate(ops) if op.kind == kind and op.a == a and (b < 0 or op.b == b)]
    return ops[:i] + ops[i + 1 :], i


ZEROS = r"found \[0\.0, 0\.0, 0\.0, 0\.0\]$"


def test_dropped_copy(run, check):
    ops, _ = _without(run[0], "copy", 8, 9)
    with pytest.raises(IntegrityError, match=re.compile(
            r"^step 1, sequence 'A': position 8 \(block-table entry 2, physical block 9\), layer 0 K head 0: "
            r"expected \[.*\], " + ZEROS)):
        _replay(run, ops, check)


@pytest.mark.parametrize("kind,a,b", [("swap_in", 2, 13), ("swap_out", 10, 2)])
def test_swap_pair_reversed(run, kind, a, b, check):
    ops = list(run[0])
    _, i = _without(ops, kind, a, b)
    ops[i] = replace(ops[i], a=b, b=a)
    with pytest.raises(IntegrityError, match=re.compile(
            r"^step 4, sequence 'B': position 8 \(block-table entry 2, physical block 13\), layer 0 K head 0: .*"
            + ZEROS)):
        _replay(run, ops, check)


def test_dropped_move(run, check):
    ops, _ = _without(run[0], "move", 14, 1)
    with pytest.raises(IntegrityError, match=re.compile(
            r"^step 6, sequence 'B': position 13 \(block-table entry 3, physical block 14\), layer 0 K head 0: .*"
            + ZEROS)):
        _replay(run, ops, check)


def test_wrong_prefix_hit(run, check):
    ops = list(run[0])
    (i,) = [i for i, op in enumerate(ops) if op.kind == "table" and op.seq == "B" and op.b == 1 and op.step == 1]
    ops[i] = replace(ops[i], a=2)  # B's second block claims the filler's block: a wrong cache hit
    with pytest.raises(IntegrityError, match=r"^step 1, sequence 'B': position 4 \(block-table entry 1, "
                                             r"physical block 2\), layer 0 K head 0: expected \[.*\], found \[.*\]$"):
        _replay(run, ops, check)


def test_missing_table_entry(run, check):
    ops, _ = _without(run[0], "table", 13, 2)
    with pytest.raises(IntegrityError, match=r"^step 4, sequence 'B': position 8 has no block-table entry 2$"):
        _replay(run, ops, check)


def test_lenient_replay_counts_every_wrong_token(run, check):
    ops, _ = _without(run[0], "copy", 8, 9)
    rep = _replay(run, ops, check, strict=False)
    assert not rep.ok
    assert rep.mismatches == 10  # positions 8 and 9 of A, read back in each of steps 1 to 5
    assert rep.errors[0].startswith("step 1, sequence 'A': position 8 (block-table entry 2, physical block 9)")
    assert len(rep.errors) == 5
