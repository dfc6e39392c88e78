"""Loaders on the real public traces: counts, exact synthesized tokens, ordering, streaming."""

import itertools
import json
from itertools import pairwise

import numpy as np
import pytest

from kvsim.workloads.mooncake import mooncake_tokens
from kvsim.workloads.ragpulse import PAD_BASE
from kvsim.workloads.traces import detect_format, load_workload


def first(wl, n=1):
    return list(itertools.islice(wl, n))


@pytest.mark.parametrize(
    ("rel", "fmt", "count"),
    [
        ("mooncake/conversation_trace.jsonl", "mooncake", 12031),
        ("mooncake/synthetic_trace.jsonl", "mooncake", 3993),
        ("azure2023/AzureLLMInferenceTrace_conv.csv", "azure", 19366),
        ("azure2023/AzureLLMInferenceTrace_code.csv", "azure", 8819),
        ("ragpulse", "ragpulse", 7106),
        ("ragpulse/0_trace.jsonl", "ragpulse", 7106),
    ],
)
def test_detects_and_counts(traces, rel, fmt, count):
    path = traces / rel
    assert detect_format(path) == fmt
    wl = load_workload(path)
    n = 0
    last = 0.0
    for r in wl:
        assert r.arrival >= last
        last = r.arrival
        n += 1
    assert n == count and wl.skipped == 0


def test_mooncake_prompts_come_from_hash_ids(traces):
    wl = load_workload(traces / "mooncake/conversation_trace.jsonl")
    r1, r2 = first(wl, 2)
    assert (r1.id, r1.arrival, r1.prompt_len, r1.output_len) == ("1", 0.0, 6758, 500)
    assert callable(r1._prompt)  # lazy until asked: streaming stays small
    assert np.array_equal(r1.prompt, np.arange(6758))  # hash ids 0..13
    assert np.array_equal(r2.prompt[:512], np.arange(512))  # shared block 0
    assert np.array_equal(r2.prompt[512:1024], 14 * 512 + np.arange(512))
    last = list(wl)[-1]
    assert (last.id, last.arrival, last.prompt_len) == ("12031", 3536.999, 20774)


def test_mooncake_tokens_never_collide_across_ids_at_any_block_size():
    a = mooncake_tokens(np.array([3, 4]), 1000)
    b = mooncake_tokens(np.array([3, 5]), 1024)
    assert len(a) == 1000 and np.array_equal(a[:512], b[:512])
    assert not set(a[512:].tolist()) & set(b[512:].tolist())


def test_mooncake_ideal_hits_match_hash_id_prefixes(traces):
    """At block size 512 the synthesized tokens must reproduce the trace's own sharing."""
    from kvsim.workloads.stats import describe

    path = traces / "mooncake/conversation_trace.jsonl"
    seen, hit, full = set(), 0, 0
    with open(path) as fh:
        for line in fh:
            d = json.loads(line)
            nf = d["input_length"] // 512
            ids = d["hash_ids"][:nf]
            j = 0
            while j < nf and ids[j] in seen:
                j += 1
            hit, full = hit + j, full + nf
            seen.update(ids)
    s = describe(load_workload(path), 512)
    assert (s.hit_blocks, s.full_blocks) == (hit, full) == (105592, 276491)


def test_azure_prompts_are_unique_and_arrivals_relative(traces):
    wl = load_workload(traces / "azure2023/AzureLLMInferenceTrace_conv.csv")
    r = first(wl, 3)
    assert [x.id for x in r] == ["2", "3", "4"]  # CSV line numbers
    assert [x.arrival for x in r] == [0.0, 4.314579, 4.541877]
    assert [(x.prompt_len, x.output_len) for x in r] == [(374, 44), (396, 109), (879, 55)]
    assert np.array_equal(r[1].prompt, np.arange(374, 770))


def test_ragpulse_is_sorted_stably_with_sessions(traces):
    wl = load_workload(traces / "ragpulse")
    reqs = list(wl)
    assert (reqs[0].id, reqs[0].arrival, reqs[0].session) == (
        "3801",
        0.0,
        "1758081635837-uficr5ams6tj",
    )
    assert reqs[-1].arrival == 604603.0
    for a, b in pairwise(reqs):
        assert a.arrival < b.arrival or int(a.id) < int(b.id)  # ties keep file order
    assert len({r.session for r in reqs}) == 3990


def test_ragpulse_prompt_is_chunks_in_order_then_filler(traces):
    wl = load_workload(traces / "ragpulse/0_trace.jsonl")
    r = next(x for x in wl if x.id == "1")
    p = r.prompt
    assert (r.prompt_len, r.output_len) == (3112, 192)

    def chunk(cid, kind, n):
        return (cid * 5 + kind) * 512 + np.arange(n)

    # sys_prompt 8302 (512), 14332 (512), 15199 (437); ...; history 15200 (11); user 26923 (7)
    assert np.array_equal(p[:512], chunk(8302, 0, 512))
    assert np.array_equal(p[512:1024], chunk(14332, 0, 512))
    assert np.array_equal(p[1024:1461], chunk(15199, 0, 437))
    assert np.array_equal(p[3096 - 11 : 3096], chunk(15200, 2, 11))
    assert np.array_equal(p[3096:3103], chunk(26923, 4, 7))
    assert np.all(p[3103:] >= PAD_BASE) and len(p) == 3112  # 9 filler tokens


def test_streaming_re_reads_the_file_each_pass(traces):
    wl = load_workload(traces / "mooncake/synthetic_trace.jsonl")
    a, b = first(wl, 5), first(wl, 5)
    assert [x.id for x in a] == [x.id for x in b] == ["1", "2", "3", "4", "5"]
    assert a[0] is not b[0]
