"""Deferred caching (`KVCacheManager.defer_unique_caching`): a cache of blocks that all hold a unique
decoded token is owed until the sequence's blocks are freed, and nothing the pool shows differs.

vLLM 0.33 caches a request's full blocks as it schedules them (vllm/v1/core/kv_cache_manager.py
`KVCacheManager.allocate_slots` -> `coordinator.cache_blocks(request, num_tokens_to_cache)`); the
deferral is kvsim's exact speed shortcut over that rule, so these tests hold it to the eager manager:
the same free queue (order, keys), the same evictions and ops, the same hits."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsim.kvcache.manager import KVCacheManager
from tests.kvcache.conftest import decode, prefill, seq


def _shown(m: KVCacheManager) -> tuple:
    """What the pool shows: its free queue in order with each block's key, evictions and op counts."""
    free = [(b.block_id, b.block_hash) for b in m.next_free_blocks(m.num_free_blocks)]
    return free, m.num_cached_free_blocks, m.pool.num_evictions, dict(m.op_counts)


def _pair(num_blocks: int = 10, block_size: int = 4) -> tuple[KVCacheManager, KVCacheManager]:
    eager, deferred = KVCacheManager(num_blocks, block_size), KVCacheManager(num_blocks, block_size)
    deferred.defer_unique_caching()
    return eager, deferred


def test_a_unique_block_is_owed_until_its_sequence_is_freed():
    eager, deferred = _pair()
    for m in (eager, deferred):
        a = seq("a", range(6), output=[50, 51])  # 8 tokens known: blocks 0 and 1
        prefill(m, a)  # 6 computed, 7 known
        for _ in range(6):  # computes tokens 6..11: block 1 (known tokens) fills at 8, block 2 at 12
            decode(m, a)
        # block 2 holds tokens 8..11, past the 8 known: a unique key, owed
        assert m.num_cached_block["a"] == (3 if m is eager else 2)
        assert _shown(m)[1] == 0
        m.free(a)
    assert deferred._owed == {}
    assert _shown(deferred) == _shown(eager)
    assert len(deferred.pool.cached) == len(eager.pool.cached) == 3  # the unique block too, once freed
    b = seq("b", list(range(6)) + [50, 51] + [0] * 4, uid=1)
    assert deferred.get_computed_blocks(b)[1] == eager.get_computed_blocks(b)[1] == 8


def test_a_smaller_ask_after_a_larger_one_owes_no_less():
    """The eager manager caches nothing on a smaller ask after a larger one; the deferred one keeps
    owing the larger (the async output's schedule and update ask with different counts)."""
    eager, deferred = _pair()
    for m in (eager, deferred):
        a = seq("a", range(6), output=[50, 51])  # 8 known: blocks 2.. hold unique tokens
        prefill(m, a)
        for _ in range(10):
            decode(m, a)  # 16 computed: blocks 2 and 3 full
        m.cache_blocks(a, 16)
        m.cache_blocks(a, 12)
        m.free(a)
    assert _shown(deferred) == _shown(eager)
    assert len(deferred.pool.cached) == len(eager.pool.cached) == 4


def test_a_known_block_is_cached_when_asked():
    """A block within the known tokens (a prompt's, or a known output's) is cached when asked: another
    request's prompt may hold the same tokens."""
    eager, deferred = _pair()
    for m in (eager, deferred):
        a = seq("a", range(6), output=[50, 51, 52, 53, 54, 55])  # 12 known: blocks 0..2
        prefill(m, a)
        for _ in range(6):
            decode(m, a)  # block 2 (tokens 8..11, all known) fills at 12
        assert m.num_cached_block["a"] == 3
    assert deferred._owed == {}


def test_deferral_refuses_what_shows_the_order_of_caches():
    with pytest.raises(ValueError, match="deferred caching"):
        KVCacheManager(10, 4, kv_events=True).defer_unique_caching()
    with pytest.raises(ValueError, match="deferred caching"):  # a window frees blocks its sequence still runs past
        KVCacheManager(10, 4, sliding_window=8).defer_unique_caching()


@settings(max_examples=200, deadline=None, derandomize=True)
@given(block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(8, 40),
       script=st.lists(st.tuples(st.sampled_from(["new", "decode", "free"]), st.integers(0, 5),
                                 st.integers(1, 12), st.integers(0, 6)), min_size=1, max_size=60))
def test_deferred_and_eager_managers_show_the_same_pool(block_size: int, num_blocks: int, script) -> None:
    """Random admissions (prompts sharing prefixes, some with known output), decodes and frees, the
    same on both: after every operation the free queue, cached free blocks, evictions, op counts and
    hits are the same."""
    eager, deferred = _pair(num_blocks, block_size)
    made = 0
    live: dict[KVCacheManager, dict[str, object]] = {eager: {}, deferred: {}}
    for op, pick, length, known in script:
        if op == "new":
            sid, made = f"s{made}", made + 1
            prompt = [pick * 7 + i % 3 for i in range(length)]  # a few prefixes, shared
            for m in (eager, deferred):
                s = seq(sid, prompt, uid=made, output=[90 + i for i in range(known)] or None)
                blocks, hit = m.get_computed_blocks(s)
                if m.allocate_slots(s, s.num_tokens - hit, hit, blocks) is not None:
                    s.num_computed_tokens = s.num_tokens
                    s.append_tokens(1)
                    live[m][sid] = s
        elif live[eager]:
            sid = sorted(live[eager])[pick % len(live[eager])]
            for m in (eager, deferred):
                s = live[m][sid]
                if op == "free" or decode(m, s) is None:
                    m.free(s)
                    del live[m][sid]
        assert live[eager].keys() == live[deferred].keys()
        assert _shown(deferred) == _shown(eager)
        probe = seq("probe", [pick * 7 + i % 3 for i in range(length)] + [90, 91, 92], uid=10_000)
        assert deferred.get_computed_blocks(probe)[1] == eager.get_computed_blocks(probe)[1]
