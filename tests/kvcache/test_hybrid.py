"""vLLM 0.33's hybrid KV-cache groups: one group's rules by kind (`kvcache.groups`) and the groups
over one pool (`kvcache.hybrid`), hand-worked, each against the vLLM function it follows.

vllm/v1/core/single_type_kv_cache_manager.py: `FullAttentionManager`, `SlidingWindowManager`,
`ChunkedLocalAttentionManager` (`find_longest_cache_hit`, `get_num_skipped_tokens`,
`get_num_blocks_to_allocate`, `remove_skipped_blocks`); vllm/v1/core/kv_cache_coordinator.py:
`HybridKVCacheCoordinator.find_longest_cache_hit`, `KVCacheCoordinator.free` and
`pop_blocks_for_free`; vllm/v1/kv_cache_interface.py `max_admission_blocks_per_request`.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsim.kvcache.block import KVCacheBlock
from kvsim.kvcache.groups import (
    GroupSpec,
    blocks_to_allocate,
    find_longest_cache_hit,
    group_salt,
    null_skipped,
)
from kvsim.kvcache.hybrid import HybridKVCacheManager
from kvsim.kvcache.manager import KVCacheManager
from kvsim.kvcache.sequence import Sequence

NULL = KVCacheBlock(0)
FULL, SW8, CHUNK8 = GroupSpec("full", 4), GroupSpec("sliding_window", 4, 8), GroupSpec("chunked_local", 4, 8)


def _lookup(cached: set[int]):
    """A lookup over one group where block i is cached iff i is in `cached` (block id i + 100)."""
    return lambda i: [KVCacheBlock(100 + i)] if i in cached else None


def _ids(blocks):
    return [b.block_id for b in blocks]


def test_full_attention_hits_the_run_of_cached_blocks_from_the_start():
    found, n = find_longest_cache_hit(FULL, 28, _lookup({0, 1, 2, 4, 5}), 1, NULL)
    assert (_ids(found[0]), n) == ([100, 101, 102], 12)


def test_a_sliding_window_hit_needs_only_the_blocks_its_window_reads():
    # window 8, blocks of 4: cdiv(8 - 1, 4) = 2 cached blocks in a row end a hit. Scanning from the
    # right (blocks 0-6 of 28 tokens): 6 misses, 5 hits, 4 and 3 miss, 2 and 1 hit: a hit of 3 blocks
    found, n = find_longest_cache_hit(SW8, 28, _lookup({1, 2, 5}), 1, NULL)
    assert (_ids(found[0]), n) == ([0, 101, 102], 12)
    # no such run: only a run from block 0 counts
    found, n = find_longest_cache_hit(SW8, 28, _lookup({0, 3, 5}), 1, NULL)
    assert (_ids(found[0]), n) == ([100], 4)


def test_chunked_local_attention_looks_only_inside_the_last_chunk():
    # ChunkedLocalAttentionManager's docstring, chunk 8, blocks of 4: with at most 15 tokens the next
    # token's chunk starts at 8, so blocks 0 and 1 are null and block 2 is looked up
    found, n = find_longest_cache_hit(CHUNK8, 15, _lookup({2}), 1, NULL)
    assert (_ids(found[0]), n) == ([0, 0, 102], 12)
    found, n = find_longest_cache_hit(CHUNK8, 15, _lookup(set()), 1, NULL)
    assert (_ids(found[0]), n) == ([0, 0], 8)
    # at 16 tokens the next token starts a chunk: every block is out of reach, 16 tokens "hit"
    found, n = find_longest_cache_hit(CHUNK8, 16, _lookup(set()), 1, NULL)
    assert (_ids(found[0]), n) == ([0, 0, 0, 0], 16)


def test_groups_with_one_spec_are_looked_up_together():
    # two groups of one spec: a block hits only if both groups have it
    both = lambda i: [KVCacheBlock(100 + i), KVCacheBlock(200 + i)] if i < 2 else None  # noqa: E731
    found, n = find_longest_cache_hit(FULL, 20, both, 2, NULL)
    assert ([_ids(t) for t in found], n) == ([[100, 101], [200, 201]], 8)


def test_skipped_tokens_by_kind():
    # SlidingWindowManager.get_num_skipped_tokens(7) with window 4 is 4; chunked local's examples 13 -> 8,
    # 8 -> 8, 7 -> 0 (chunk 8)
    assert GroupSpec("sliding_window", 4, 4).skipped_tokens(7) == 4
    assert [CHUNK8.skipped_tokens(c) for c in (13, 8, 7)] == [8, 8, 0]
    assert FULL.skipped_tokens(10_000) == 0


def test_admission_caps_by_kind():
    # SlidingWindowSpec: cdiv(min(W - 1 + in flight, max len), block) + 1; chunked local: cdiv(C + in flight)
    assert SW8.admission_cap(8, None) == 4 + 1  # cdiv(15, 4) + 1
    assert SW8.admission_cap(8, 10) == 3 + 1
    assert CHUNK8.admission_cap(8, None) == 4
    assert FULL.admission_cap(8, None) is None


def test_blocks_to_allocate_counts_skipped_blocks_and_free_hits():
    # a new request, 40 tokens, window 8: 10 blocks, 15 computed tokens skip cdiv... (15 - 7) // 4 = 2
    # blocks; 3 hit blocks [null, null, b] (ref 0: in the free queue) -> 10 - max(2, 3) new + 1 free hit
    hit = KVCacheBlock(7)
    n = blocks_to_allocate(SW8, (), False, 40, [NULL, NULL, hit], 15, None,
                           lambda hits: sum(1 for b in hits if b is not NULL and b.ref_cnt == 0))
    assert n == 7 + 1
    # the whole-sequence gate caps the window's blocks
    assert blocks_to_allocate(SW8, (), False, 400, [], 0, 5, lambda hits: 0) == 5
    # a running request (its blocks counted as cached): only the blocks past its table
    assert blocks_to_allocate(SW8, [NULL] * 6, True, 40, [], 0, None, lambda hits: 0) == 4


def test_blocks_a_window_no_longer_reads_become_null_from_the_last_back():
    blocks = [KVCacheBlock(i) for i in range(1, 7)]
    removed = null_skipped(SW8, blocks, 19, NULL)  # skips 19 - 7 = 12 tokens: blocks 0-2
    assert _ids(removed) == [3, 2, 1] and _ids(blocks) == [0, 0, 0, 4, 5, 6]
    assert null_skipped(SW8, blocks, 20, NULL) == []  # 13 tokens: still three blocks, all null already


def test_group_zero_keys_as_one_group_and_every_other_group_apart():
    assert group_salt(0) == 0
    salts = [group_salt(g) for g in range(1, 64)]
    assert len(set(salts)) == 63 and all(s & 1 for s in salts)


def _seq(sid: str, tokens) -> Sequence:
    return Sequence(sid, np.asarray(tokens, dtype=np.int64))


def test_the_hybrid_hit_is_the_shortest_a_group_can_resume_from_and_marks_the_junction():
    # full + window 8 (blocks of 4), dense caching: a 26-token prompt caches 6 full blocks in each group.
    # A sibling sharing its first 22 tokens: full attention hits 5 blocks (20 tokens); the window needs
    # blocks 3-4 of its own, which it has: 20 tokens, no junction
    m = HybridKVCacheManager(64, [SW8, FULL], prefix_cache_retention_interval=None)
    a = _seq("a", range(26))
    assert m.allocate_slots(a, 26, 0, m.get_computed_blocks(a)[0]) is not None
    m.free(a)
    b = _seq("b", [*range(22), 900, 901, 902, 903, 904, 905])
    hits, n = m.get_computed_blocks(b)
    assert (n, [len(h) for h in hits], m.junctions["b"]) == (20, [5, 5], 0)
    assert _ids(hits[0][:3]) == [0, 0, 0]  # the window's hit: nulls before the blocks it reads


def test_sparse_retention_in_one_group_lowers_the_hit_and_marks_the_shared_prefix_junction():
    # Under retention 0 the window hashes only the tail before a's replay boundary (token 25: blocks 4-5).
    # b shares 22 tokens: full attention offers 5 blocks, the window has no two-block run ending at or
    # before block 5 among its hashed ones but blocks 4.. are not b's: it falls back to a run from block 0,
    # none: hit 0. Full attention cached 20 tokens the window did not: the junction, which b then
    # hashes as a boundary, so a third request sharing the 22 tokens hits 20
    m = HybridKVCacheManager(64, [SW8, FULL], prefix_cache_retention_interval=0)
    a = _seq("a", range(26))
    m.allocate_slots(a, 26, 0, m.get_computed_blocks(a)[0])
    m.free(a)
    b = _seq("b", [*range(22), 900, 901, 902, 903, 904, 905])
    hits, n = m.get_computed_blocks(b)
    assert (n, m.junctions["b"]) == (0, 20)
    m.allocate_slots(b, b.num_tokens, n, hits)
    m.free(b)
    c = _seq("c", [*range(22), 700, 701, 702, 703, 704, 705])
    assert m.get_computed_blocks(c)[1] == 20


def test_admission_sums_over_groups_and_caps_the_window():
    # 100 tokens: full attention 25 blocks; the window at most cdiv(8 - 1 + 8, 4) + 1 = 5 under the gate
    m = HybridKVCacheManager(64, [SW8, FULL], in_flight_tokens=8)
    s = _seq("s", range(100))
    assert m.num_blocks_to_allocate(s, 100, capped=True) == 30
    assert m.num_blocks_to_allocate(s, 100) == 50


def test_a_request_frees_group_by_group_each_tail_first():
    # KVCacheCoordinator.free: group 0's blocks (reversed), then group 1's. With caching, the uncached
    # tail of each goes to the front of the free queue (group 1's freed last, so in front), the cached
    # blocks to the back in that order
    m = HybridKVCacheManager(32, [SW8, FULL], prefix_cache_retention_interval=None)
    s = _seq("s", range(17))
    m.allocate_slots(s, 17, 0, m.get_computed_blocks(s)[0])
    assert [m.block_ids("s", g) for g in (0, 1)] == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    m.free(s)
    order = _ids(m.next_free_blocks(31))
    assert order[:2] == [10, 5] and order[-8:] == [4, 3, 2, 1, 9, 8, 7, 6]


def test_a_deferred_free_returns_the_groups_blocks_from_the_end_of_their_list():
    # pop_blocks_for_free concatenates the groups' tables; the scheduler frees the list reversed
    m = HybridKVCacheManager(32, [SW8, FULL], prefix_cache_retention_interval=None)
    s = _seq("s", range(17))
    m.allocate_slots(s, 17, 0, m.get_computed_blocks(s)[0])
    popped = m.pop_blocks_for_free(s)
    assert _ids(popped) == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert m.held == [5, 5]  # in use until they are returned, each counted for its group
    m.free_popped(popped)
    assert m.held == [0, 0]
    order = _ids(m.next_free_blocks(31))
    # one call: its uncached blocks to the front in its order (BlockPool.free_blocks, prepend_n), group 1's
    # first; and group 1's cached blocks now evicted before group 0's
    assert order[:2] == [10, 5] and order[-8:] == [9, 8, 7, 6, 4, 3, 2, 1]


def test_a_window_returns_its_blocks_as_the_request_decodes():
    m = HybridKVCacheManager(64, [SW8, FULL])
    s = _seq("s", range(12))
    m.allocate_slots(s, 12, 0, m.get_computed_blocks(s)[0])
    s.num_computed_tokens = 12
    for _ in range(12):  # decode to 24 tokens, one at a time
        s.append_tokens(1)
        assert m.allocate_slots(s, 1) is not None
        s.num_computed_tokens += 1
    # 23 computed before the last step: 23 - 7 = 16 tokens skipped, blocks 0-3 null in the window's table
    assert m.block_ids("s", 0)[:4] == [0, 0, 0, 0] and 0 not in m.block_ids("s", 1)
    assert m.group_block_counts() == [2, 6]


def test_under_async_output_a_window_lets_go_on_the_processed_tokens():
    # vllm/v1/core/kv_cache_manager.py KVCacheManager.allocate_slots (0.33): remove_skipped_blocks at
    # max(0, computed - num_in_flight_tokens). With 8 of 24 computed tokens in flight, the window of 8
    # skips the blocks of 16 - 7 = 9 processed tokens (2 of 4 tokens), not of 24 - 7 = 17 (4)
    def run(in_flight):
        m = HybridKVCacheManager(64, [SW8, FULL])
        s = _seq("s", range(24))
        m.allocate_slots(s, 24, 0, m.get_computed_blocks(s)[0])
        s.num_computed_tokens = 24
        s.append_tokens(1)
        assert m.allocate_slots(s, 1, in_flight=in_flight) is not None  # the decode path
        t = _seq("t", range(100, 130))
        m.allocate_slots(t, 20, 0, m.get_computed_blocks(t)[0])
        t.num_computed_tokens = 20
        assert m.allocate_slots(t, 10, in_flight=in_flight) is not None  # the general path
        return m.block_ids("s", 0).count(0), m.block_ids("t", 0).count(0)

    assert run(0) == (4, 3)  # 24 - 7 = 17 tokens: 4 blocks; 20 - 7 = 13: 3 blocks
    assert run(8) == (2, 1)  # 16 - 7 = 9: 2 blocks; 12 - 7 = 5: 1 block


def test_refuses_groups_of_different_block_sizes_and_retention_without_a_window():
    with pytest.raises(ValueError, match="different block sizes"):
        HybridKVCacheManager(64, [GroupSpec("full", 16), GroupSpec("sliding_window", 32, 64)])
    with pytest.raises(ValueError, match="no sliding-window or Mamba group"):
        HybridKVCacheManager(64, [FULL, CHUNK8], prefix_cache_retention_interval=16)


def _workload(draw_tokens, n):
    """n prompts over a small vocabulary of shared prefixes, with their output lengths."""
    out = []
    for i in range(n):
        prefix = draw_tokens[i % len(draw_tokens)]
        out.append((f"r{i}", [*prefix, *range(1000 + 37 * i, 1000 + 37 * i + 5 + i % 11)]))
    return out


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 50), min_size=1, max_size=60), min_size=1, max_size=4),
       st.integers(12, 80), st.sampled_from([None, 0]))
def test_one_full_group_hits_as_the_one_group_manager_and_every_block_comes_back(prefixes, blocks, retention):
    """The hybrid manager over a full-attention group alone is the one-group manager (the unitary
    coordinator); over a window and full attention, every block it takes comes back once every
    request is freed."""
    ours = HybridKVCacheManager(blocks, [FULL])
    theirs = KVCacheManager(blocks, 4)
    hybrid = HybridKVCacheManager(blocks * 2, [SW8, FULL], prefix_cache_retention_interval=retention)
    for sid, tokens in _workload(prefixes, 12):
        got = []
        for m in (ours, theirs, hybrid):
            s = _seq(sid, tokens)
            hits, n = m.get_computed_blocks(s)
            ok = m.allocate_slots(s, s.num_tokens - n, n, hits) is not None
            got.append((n, ok) if m is not hybrid else None)
            if ok:
                m.free(s)
        assert got[0] == got[1]
    for m in (ours, theirs, hybrid):
        assert m.num_free_blocks == m.num_usable_blocks
        assert all(b.ref_cnt == 0 for b in m.pool.blocks[1:])


def _naive_window_hit(cached: set[int], max_blocks: int, need: int) -> tuple[list[int], int]:
    """vLLM's scan as written (SlidingWindowManager.find_longest_cache_hit): every block from the right."""
    out, run = [0] * max_blocks, 0
    for i in range(max_blocks - 1, -1, -1):
        if i not in cached:
            run = 0
            continue
        out[i] = 100 + i
        run += 1
        if run >= need:
            return out[: i + run], (i + run) * 4
    return out[:run], run * 4


@settings(max_examples=300, deadline=None)
@given(st.sets(st.integers(0, 40), max_size=40), st.integers(0, 41), st.integers(1, 9))
def test_the_window_scan_that_skips_finds_the_hit_vllms_full_scan_finds(cached, max_blocks, window_blocks):
    spec = GroupSpec("sliding_window", 4, 4 * window_blocks)  # needs cdiv(4w - 1, 4) = w blocks
    found, n = find_longest_cache_hit(spec, max_blocks * 4, _lookup(cached), 1, NULL)
    assert (_ids(found[0]), n) == _naive_window_hit(cached, max_blocks, window_blocks)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 40), st.integers(0, 40), st.integers(1, 40), st.integers(1, 12), st.sampled_from([None, 0]),
       st.booleans())
def test_what_a_quiet_visit_may_let_go_or_cache_is_what_the_decode_then_does(shared, own, output, chunk, retention,
                                                                             chunked_group):
    """`num_skipped_blocks` (what `sim.engine.quiet` lets a blocked head gain from a visit) is
    exactly the count `remove_skipped_blocks` then takes out of the tables, as a request prefills in
    chunks of `chunk` tokens and decodes; and a block cached while `caches_watched` said no leaves a
    watched lookup unchanged (`hit_unchanged`). Two identical window groups, full attention and
    optionally a chunked-local group; the watched head shares `shared` tokens with the request's
    prompt and answer (vllm/v1/core/single_type_kv_cache_manager.py `remove_skipped_blocks`)."""
    groups = [SW8, SW8, FULL] + ([CHUNK8] if chunked_group else [])
    m = HybridKVCacheManager(400, groups, prefix_cache_retention_interval=retention if not chunked_group else None)
    prompt = list(range(shared // 2 + 1))
    answer = list(range(500, 500 + output))
    s = Sequence("s", np.asarray(prompt + list(range(200, 200 + own)), dtype=np.int64),
                 output=np.asarray(answer, dtype=np.int64))
    head_tokens = (prompt + list(range(200, 200 + own)) + answer)[:shared] + [999, 998, 997, 996, 995]
    head = _seq("h", head_tokens)
    hits, _ = m.get_computed_blocks(s)
    assert m.allocate_slots(s, min(chunk, s.num_tokens), 0, hits) is not None
    s.num_computed_tokens = min(chunk, s.num_tokens)
    m.watch_hit(head, m.get_computed_blocks(head)[0])
    for _ in range(s.num_prompt_tokens + output):
        c = s.num_computed_tokens
        if c >= s.num_prompt_tokens:
            s.append_tokens(1)
        n = min(chunk, s.num_tokens - c)
        predicted = m.num_skipped_blocks(s)
        watched = m.caches_watched(s, c + n)
        unchanged = m.hit_unchanged()
        before = sum(m.freed_behind)
        assert m.allocate_slots(s, n) is not None
        assert sum(m.freed_behind) - before == predicted
        # groups of one spec hold their null blocks alike (one span serves both: `groups.skipped_span`)
        assert [b.block_id == 0 for b in m.tables[0]["s"]] == [b.block_id == 0 for b in m.tables[1]["s"]]
        if unchanged and not watched:
            assert m.hit_unchanged()
        s.num_computed_tokens = c + n
