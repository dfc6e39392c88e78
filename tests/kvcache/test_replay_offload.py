"""The cache replay over a host tier (KV offloading with instantaneous transfers), on hand-traced
workloads: block size 4, so a prompt of range(12) is three blocks (and three chunks of one block)."""

from __future__ import annotations

from dataclasses import astuple

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsim.kvcache.manager import KVCacheManager
from kvsim.kvcache.offload.tier import HostTier
from kvsim.kvcache.replay import Offload, replay
from kvsim.workloads.request import make_request

A, B = list(range(12)), list(range(100, 112))


def req(i: int, prompt, out: int = 1, output=None):
    return make_request(f"r{i}", float(i), np.asarray(prompt), out, output=output)


def run(reqs, num_blocks: int, chunks: int, *, bpc: int = 1, prompt_only: bool = True, k: int = 1):
    """The replay's records (id, GPU hit, tier hit, status) and totals, and the tier."""
    tier, recs = HostTier(chunks), []
    res = replay(reqs, KVCacheManager(num_blocks, 4), k, recs.append, Offload(tier, bpc, prompt_only))
    return [(r.id, r.hit_tokens, r.offload_hit_tokens, r.status) for r in recs], res, tier


def test_a_request_evicted_from_the_gpu_is_loaded_from_the_tier_on_its_return():
    # 3 usable GPU blocks: B evicts A's three blocks; A's stored chunks come back from the tier,
    # the whole prompt (12 tokens), its last token computed again
    recs, res, tier = run([req(0, A), req(1, B), req(2, A)], num_blocks=4, chunks=8)
    assert recs == [("r0", 0, 0, "finished"), ("r1", 0, 0, "finished"), ("r2", 0, 12, "finished")]
    assert (res.stored_blocks, res.loaded_blocks, res.offload_evictions, res.evicted_blocks) == (6, 3, 0, 6)
    assert (res.offload_hit_tokens, res.total_hit_rate, res.host_chunks) == (12, 12 / 36, 8)
    assert tier.num_resident == 6
    assert res.as_dict()["total_hit_rate"] == 12 / 36


def test_a_tier_too_small_for_a_prompt_stores_nothing():
    # all or nothing: three new chunks never fit two slots (offered at admission and at finish)
    recs, res, tier = run([req(0, A), req(1, B), req(2, A)], num_blocks=4, chunks=2)
    assert recs == [("r0", 0, 0, "finished"), ("r1", 0, 0, "finished"), ("r2", 0, 0, "finished")]
    assert (res.stored_blocks, res.loaded_blocks, tier.num_alloc_failures, tier.num_resident) == (0, 0, 6, 0)


def test_a_small_tier_evicts_lru_and_the_hit_stops_at_the_first_miss():
    # 4 chunks: B's store evicts A's tail (A2, A1: A's head was used last); A's return loads A0
    # only, then stores A1, A2 over B's tail (B2, B1; A0, just read by r2, ranks above them)
    recs, res, tier = run([req(0, A), req(1, B), req(2, A)], num_blocks=4, chunks=4)
    assert recs == [("r0", 0, 0, "finished"), ("r1", 0, 0, "finished"), ("r2", 0, 4, "finished")]
    assert (res.stored_blocks, res.loaded_blocks, res.offload_evictions) == (8, 1, 4)
    assert tier.num_resident == 4


def test_two_blocks_a_chunk_load_whole_chunks_only():
    # 4 usable GPU blocks; A16 is 16 tokens, two chunks of 8. B leaves A's first block on the
    # GPU (a 4-token hit); the tier continues it over both chunks (the first one half hit):
    # 12 tokens into 3 new blocks
    a16 = list(range(16))
    recs, res, _ = run([req(0, a16), req(1, B), req(2, a16)], num_blocks=5, chunks=4, bpc=2)
    assert recs == [("r0", 0, 0, "finished"), ("r1", 0, 0, "finished"), ("r2", 4, 12, "finished")]
    # r0 stores 2 chunks, r1 one (its 12 tokens are one and a half chunks)
    assert (res.stored_blocks, res.loaded_blocks) == (6, 3)


def test_two_blocks_a_chunk_a_half_chunk_is_not_loaded():
    # A is 12 tokens: one chunk (tokens 0-7) and a half; with A's first block still a GPU hit,
    # the tier would add only 4 tokens, less than a chunk: nothing is loaded
    recs, res, _ = run([req(0, A), req(1, range(100, 108)), req(2, A)], num_blocks=4, chunks=4, bpc=2)
    assert recs == [("r0", 0, 0, "finished"), ("r1", 0, 0, "finished"), ("r2", 4, 0, "finished")]
    assert (res.stored_blocks, res.loaded_blocks) == (4, 0)


def test_prompt_only_against_offloading_the_output_too():
    # a chat turn: r0's answer (50..54) is part of r2's prompt; B in between evicts the GPU.
    # Offloading all, r0's finish stores the chunk of its first four answer tokens too
    turn = [req(0, range(8), 5, output=range(50, 55)), req(1, range(100, 116)),
            req(2, [*range(8), *range(50, 54), *range(60, 64)])]
    prompt_only, res_p, _ = run(turn, num_blocks=5, chunks=8)
    every, res_a, _ = run(turn, num_blocks=5, chunks=8, prompt_only=False)
    assert prompt_only[2] == ("r2", 0, 8, "finished")
    assert every[2] == ("r2", 0, 12, "finished")
    assert (res_p.stored_blocks, res_p.loaded_blocks) == (8, 2)  # 2 + 4 + r2's chunks 2 and 3
    assert (res_a.stored_blocks, res_a.loaded_blocks) == (8, 3)  # 3 + 4 + r2's chunk 3


def test_concurrent_mode_loads_on_a_return_too():
    recs, res, _ = run([req(0, A), req(1, B), req(2, A)], num_blocks=4, chunks=8, k=2)
    assert recs == [("r0", 0, 0, "finished"), ("r1", 0, 0, "finished"), ("r2", 0, 12, "finished")]
    assert (res.stored_blocks, res.loaded_blocks) == (6, 3)


def test_without_a_tier_the_result_has_no_offload_fields():
    res = replay([req(0, A)], KVCacheManager(4, 4))
    assert "offload_hit_tokens" not in res.as_dict() and res.host_chunks is None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 30), st.integers(0, 12)), min_size=1, max_size=10),
       st.integers(3, 16), st.sampled_from([1, 3]))
def test_an_empty_tier_changes_nothing(shapes, num_blocks, k):
    """A tier of 0 chunks stores and loads nothing: records and GPU evictions as without one."""
    reqs = [req(i, list(range(100 * p, 100 * p + n)), out) for i, (p, n, out) in enumerate(shapes)]
    plain, with_tier = [], []
    ref = replay(reqs, KVCacheManager(num_blocks, 4), k, plain.append)
    res = replay(reqs, KVCacheManager(num_blocks, 4), k, with_tier.append, Offload(HostTier(0)))
    assert [astuple(r)[:6] for r in with_tier] == [astuple(r) for r in plain]
    assert (res.evicted_blocks, res.stored_blocks, res.offload_hit_tokens) == (ref.evicted_blocks, 0, 0)
