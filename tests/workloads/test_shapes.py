"""Synthetic shapes: exact structure of prompts and sessions, seeded determinism."""

from collections import Counter, defaultdict
from itertools import pairwise

import numpy as np
import pytest

from kvsim.workloads.arrivals import Constant, Poisson
from kvsim.workloads.default import default_workload
from kvsim.workloads.lengths import Fixed, Uniform
from kvsim.workloads.sessions import agent, multi_turn
from kvsim.workloads.shapes import few_shot, merge, parallel, shared_prefix, zipf_weights
from kvsim.workloads.stats import describe


def same(a, b):
    """Two passes/workloads give identical requests, tokens included."""
    la, lb = list(a), list(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        assert (x.id, x.arrival, x.prompt_len, x.output_len, x.session, x.n, x.think_time) == (
            y.id,
            y.arrival,
            y.prompt_len,
            y.output_len,
            y.session,
            y.n,
            y.think_time,
        )
        assert np.array_equal(x.prompt, y.prompt)
        assert (x.output is None and y.output is None) or np.array_equal(x.output, y.output)


GENERATORS = [
    lambda s: shared_prefix(50, seed=s),
    lambda s: few_shot(50, seed=s),
    lambda s: parallel(50, seed=s),
    lambda s: multi_turn(50, seed=s),
    lambda s: agent(50, seed=s),
]


@pytest.mark.parametrize("make", GENERATORS)
def test_same_seed_same_workload_and_passes_repeat(make):
    wl = make(5)
    same(wl, wl)
    same(wl, make(5))
    assert [r.prompt_len for r in make(6)] != [r.prompt_len for r in wl]


@pytest.mark.parametrize("make", GENERATORS)
def test_arrival_order_and_valid_tokens(make):
    reqs = list(make(1))
    assert len(reqs) == 50
    assert all(a.arrival <= b.arrival for a, b in pairwise(reqs))
    assert len({r.id for r in reqs}) == 50
    assert all(r.prompt.dtype == np.int32 and r.prompt.min() >= 0 for r in reqs)


def test_zipf_weights():
    assert zipf_weights(3, 1.0).tolist() == pytest.approx([6 / 11, 3 / 11, 2 / 11])
    assert zipf_weights(4, 0.0).tolist() == [0.25] * 4


def test_shared_prefix_structure_and_popularity():
    reqs = list(
        shared_prefix(
            4000, num_prefixes=3, zipf=1.0, prefix_len=Fixed(8), user_len=Fixed(2), seed=0
        )
    )
    prefixes = {tuple(r.prompt[:8]) for r in reqs}
    assert prefixes == {tuple(range(0, 8)), tuple(range(8, 16)), tuple(range(16, 24))}
    counts = Counter(int(r.prompt[0]) for r in reqs)
    assert counts[0] / 4000 == pytest.approx(6 / 11, abs=0.02)
    assert counts[16] / 4000 == pytest.approx(2 / 11, abs=0.02)
    tails = np.concatenate([r.prompt[8:] for r in reqs])
    assert len(np.unique(tails)) == len(tails) == 8000  # user messages never repeat
    assert tails.min() == 24


def test_multi_turn_sessions_grow_by_answer_and_message():
    reqs = list(multi_turn(300, turns=Uniform(2, 5), think_time=3.0, seed=2))
    by_session = defaultdict(list)
    for r in reqs:
        by_session[r.session].append(r)
    assert len(by_session) > 40
    for sid, turns in by_session.items():
        assert [t.id for t in turns] == [f"{sid}-{i}" for i in range(len(turns))]
        assert turns[0].think_time is None
        for prev, cur in pairwise(turns):
            assert cur.think_time > 0
            assert cur.arrival == pytest.approx(prev.arrival + cur.think_time)
            context = np.concatenate([prev.prompt, prev.output])
            assert np.array_equal(cur.prompt[: len(context)], context)
            assert cur.prompt_len > len(context)
        for t in turns:
            assert t.output is not None and len(t.output) == t.output_len
    assert np.mean([r.think_time for r in reqs if r.think_time]) == pytest.approx(3.0, rel=0.15)


def test_agent_loops_have_long_growing_context_and_short_outputs():
    reqs = list(agent(200, seed=0))
    first = [r for r in reqs if r.think_time is None]
    assert all(r.prompt_len >= 2048 for r in reqs)
    assert all(np.array_equal(r.prompt[:2048], np.arange(2048)) for r in first)
    assert np.mean([r.output_len for r in reqs]) < 80
    assert max(r.prompt_len for r in reqs) > 5000


def test_few_shot_templates_share_instruction_and_example_prefixes():
    reqs = list(
        few_shot(
            500, num_tasks=2, max_shots=3, instruction_len=Fixed(4), example_len=Fixed(5), seed=0
        )
    )
    # instruction 0..3, task 0 examples 4..18, task 1 examples 19..33, queries >= 34
    combos = set()
    for r in reqs:
        shared = r.prompt[r.prompt < 34]
        k, rem = divmod(len(shared) - 4, 5)
        task = (int(shared[4]) - 4) // 15
        assert rem == 0 and 1 <= k <= 3
        assert shared.tolist() == [0, 1, 2, 3] + list(range(4 + 15 * task, 4 + 15 * task + 5 * k))
        assert np.all(r.prompt[len(shared) :] >= 34)
        combos.add((task, k))
    assert combos == {(t, k) for t in (0, 1) for k in (1, 2, 3)}


def test_parallel_sets_n_and_unique_prompts():
    reqs = list(parallel(20, n=3, arrivals=Constant(2.0), seed=0))
    assert {r.n for r in reqs} == {3}
    assert [r.arrival for r in reqs[:3]] == [0.0, 0.5, 1.0]
    allp = np.concatenate([r.prompt for r in reqs])
    assert len(np.unique(allp)) == len(allp)


def test_merge_interleaves_by_arrival_stably():
    a = parallel(3, arrivals=Constant(1.0), token_range=(0, 1000))
    b = parallel(3, arrivals=Constant(2.0), token_range=(1000, 2000))
    m = list(merge(a, b))
    assert [r.arrival for r in m] == [0.0, 0.0, 0.5, 1.0, 1.0, 2.0]
    assert m[0].prompt[0] == 0 and m[1].prompt[0] == 1000


def test_token_range_exhaustion_is_an_error():
    with pytest.raises(ValueError, match="token ids exhausted"):
        list(parallel(5, prompt_len=Fixed(10), token_range=(0, 30)))


def test_default_workload_is_fixed_and_mixes_sharing():
    wl = default_workload()
    s = describe(wl)
    assert s.requests == 300
    assert s.sessions == 40
    assert (s.prompt_tokens, s.output_tokens) == (162122, 41101)
    assert (s.full_blocks, s.hit_blocks) == (9996, 8369)
    ids = [r.id for r in wl]
    assert sum(i.startswith("sp-") for i in ids) == 150
    assert sum(i.startswith("mt-") for i in ids) == 150


def test_poisson_default_rate_shared_prefix():
    reqs = list(shared_prefix(2000, arrivals=Poisson(5.0), seed=0))
    assert (len(reqs) - 1) / reqs[-1].arrival == pytest.approx(5.0, rel=0.06)
