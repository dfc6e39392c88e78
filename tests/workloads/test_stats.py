"""Ideal prefix-cache hit rate on hand-built workloads, block keys, and describe()."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsim.workloads.request import Workload, make_request
from kvsim.workloads.stats import (
    IdealPrefixCache,
    block_keys,
    describe,
    format_stats,
    ideal_hit_rate,
)


def reqs(*prompts, outputs=None):
    outputs = outputs or [None] * len(prompts)
    return [
        make_request(f"r{i}", float(i), p, len(o) if o is not None else 1, output=o)
        for i, (p, o) in enumerate(zip(prompts, outputs, strict=True))
    ]


def test_hits_stop_at_first_miss():
    c = ideal_hit_rate(reqs([1, 2, 3, 4, 5], [1, 2, 3, 4, 9, 9], [1, 2, 7, 7]), block_size=2)
    assert (c.full_blocks, c.hit_blocks, c.hit_tokens, c.prompt_tokens) == (7, 3, 6, 15)
    assert c.block_rate() == 3 / 7
    assert c.token_rate() == 0.4


def test_equal_block_after_different_prefix_misses():
    c = ideal_hit_rate(reqs([1, 2, 3, 4], [9, 9, 3, 4]), block_size=2)
    assert (c.full_blocks, c.hit_blocks) == (4, 0)


def test_identical_prompt_hits_every_full_block():
    c = ideal_hit_rate(reqs([1, 2, 3, 4, 5], [1, 2, 3, 4, 5]), block_size=2)
    assert (c.full_blocks, c.hit_blocks, c.hit_tokens) == (4, 2, 4)


def test_known_outputs_are_cached_for_the_next_turn():
    prompts = ([1, 2, 3], [1, 2, 3, 4, 5, 6, 7])
    known = ideal_hit_rate(reqs(*prompts, outputs=[[4, 5, 6], [8]]), block_size=2)
    assert (known.full_blocks, known.hit_blocks, known.hit_tokens) == (4, 3, 6)
    unknown = ideal_hit_rate(reqs(*prompts), block_size=2)
    assert (unknown.full_blocks, unknown.hit_blocks) == (4, 1)


def test_own_output_does_not_hit_own_prompt_and_chunks_agree():
    rs = reqs([5, 6], [5, 6, 7, 8], [5, 6, 7, 8, 9, 9], outputs=[[7, 8], [9, 9], [0]])
    one = IdealPrefixCache(2)
    assert one.add(rs).tolist() == [0, 2, 3]
    split = IdealPrefixCache(2)
    assert [split.add([r]).tolist() for r in rs] == [[0], [2], [3]]
    assert (one.hit_blocks, one.full_blocks) == (split.hit_blocks, split.full_blocks) == (5, 6)


def test_prompt_shorter_than_a_block():
    c = ideal_hit_rate(reqs([1], [1]), block_size=16)
    assert (c.full_blocks, c.hit_blocks, c.block_rate(), c.token_rate()) == (0, 0, 0.0, 0.0)


def test_block_keys_are_stable_values():
    k = block_keys(np.array([1, 2, 3, 4], dtype=np.int32), 2)
    assert k.dtype == np.uint64 and len(k) == 2
    assert block_keys(np.array([1, 2, 3], dtype=np.int32), 2)[0] == k[0]
    assert block_keys(np.array([1, 2, 5, 6], dtype=np.int32), 2)[0] == k[0]
    assert block_keys(np.array([2, 1, 3, 4], dtype=np.int32), 2)[0] != k[0]
    assert len(block_keys(np.array([1], dtype=np.int32), 2)) == 0


tokens = st.lists(st.integers(0, 3), max_size=24)


@settings(max_examples=150, deadline=None)
@given(a=tokens, b=tokens, bs=st.sampled_from([1, 2, 3, 4]))
def test_block_keys_equal_iff_prefixes_equal(a, b, bs):
    ka = block_keys(np.array(a, dtype=np.int32), bs)
    kb = block_keys(np.array(b, dtype=np.int32), bs)
    for j in range(min(len(ka), len(kb))):
        assert (ka[j] == kb[j]) == (a[: (j + 1) * bs] == b[: (j + 1) * bs])


def naive_hits(prompts, outputs, bs):
    seen, hits = set(), []
    for p, o in zip(prompts, outputs, strict=True):
        nb = len(p) // bs
        j = 0
        while j < nb and tuple(p[: (j + 1) * bs]) in seen:
            j += 1
        hits.append(j)
        seq = p + (o or [])
        seen.update(tuple(seq[: (k + 1) * bs]) for k in range(len(seq) // bs))
    return hits


@settings(max_examples=100, deadline=None)
@given(
    data=st.lists(
        st.tuples(
            tokens, st.one_of(st.none(), st.lists(st.integers(0, 3), min_size=1, max_size=6))
        ),
        max_size=12,
    ),
    bs=st.sampled_from([1, 2, 4]),
    chunk=st.integers(1, 5),
)
def test_ideal_cache_matches_naive_reference(data, bs, chunk):
    prompts, outputs = [d[0] for d in data], [d[1] for d in data]
    rs = reqs(*prompts, outputs=outputs) if data else []
    cache = IdealPrefixCache(bs)
    got = []
    for i in range(0, len(rs), chunk):
        got += cache.add(rs[i : i + chunk]).tolist()
    assert got == naive_hits(prompts, outputs, bs)


def test_describe_counts_and_percentiles():
    rs = [
        make_request("a", 1.0, [1, 2, 3, 4], 10, session="s"),
        make_request("b", 3.0, [1, 2, 3, 4, 5, 6], 20, session="s"),
        make_request("c", 5.0, [9] * 10, 30),
    ]
    s = describe(Workload.from_list(rs, "tiny"), block_size=2)
    d = s.to_dict()
    assert (d["requests"], d["sessions"], d["time_span"], d["mean_rate"]) == (3, 1, 4.0, 0.5)
    assert (d["prompt_tokens"], d["output_tokens"]) == (20, 60)
    assert d["prompt_len"] == {"p50": 6.0, "p90": 9.2, "p99": pytest.approx(9.92), "mean": 20 / 3}
    assert (d["full_blocks"], d["hit_blocks"], d["hit_tokens"]) == (10, 2, 4)
    assert d["ideal_block_hit_rate"] == 0.2 and d["ideal_token_hit_rate"] == 0.2
    text = format_stats(s)
    assert "requests       3 in 1 sessions" in text
    assert "blocks       20.00% (2 / 10 full blocks)" in text


def test_describe_empty_workload():
    s = describe(Workload.from_list([], "empty"))
    assert (s.requests, s.mean_rate, s.prompt_len.p50, s.ideal_token_hit_rate) == (
        0,
        0.0,
        None,
        0.0,
    )
    assert "-" in format_stats(s)
