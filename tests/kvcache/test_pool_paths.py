"""The pool's counted fast paths (ops not recorded) against its general path (ops recorded).

`BlockPool` takes shortcuts when ops are only counted: one pass over the popped blocks
to take them, one pass to free them, an IdSpan told only counts and top ids. Two
managers that differ only in `record_ops` must end every step in the same state:
tables, ref counts, free order, cache map (duplicate keys included), counters and
the id tracker, for every policy and with or without the defragmenter.
"""

import itertools
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsim.kvcache.block import KVCacheBlock
from kvsim.kvcache.eviction import LRU
from kvsim.kvcache.groups import GroupSpec
from kvsim.kvcache.hybrid import HybridKVCacheManager
from kvsim.kvcache.invariants import check
from kvsim.kvcache.manager import KVCacheManager
from kvsim.kvcache.sequence import Sequence

BS = 4
PROMPTS = [np.arange(k * 100, k * 100 + 30, dtype=np.int32) for k in range(3)]
ANSWER = np.arange(7000, 7040, dtype=np.int32)  # a known answer: equal decodes fill equal blocks


def cache_map(pool) -> list:
    """The cache map's content: each key's blocks in their order (lookup returns the first). The keys'
    order is no part of it: an eviction that pops a shared key puts the key back at the end."""
    return sorted((k, [hit.block_id] if type(hit) is KVCacheBlock else list(hit)) for k, hit in pool.cached.items())


def state(m: KVCacheManager) -> tuple:
    pool, policy = m.pool, m.pool.policy
    cached = cache_map(pool)
    free = policy.queue.block_ids() if isinstance(policy, LRU) else (policy.plain.block_ids(), policy.num_cached)
    tracker = pool.tracker
    return (
        {sid: m.block_ids(sid) for sid in m.req_blocks}, [b.ref_cnt for b in pool.blocks[1:]], free, cached,
        pool.num_evictions, pool.num_cached_free, pool.num_free_blocks, m.op_counts["evict"], m.op_counts["free"],
        None if tracker is None else (tracker.num_used(), m.id_space_fragmentation()),
    )


def advance(m, s: Sequence, n: int, hit: int = 0, blocks=None) -> bool:
    """Compute `n` more tokens of `s` (after `hit` cached ones, a new request's); a token is sampled
    once the known ones are all computed. False (nothing changes) where they do not fit."""
    if m.allocate_slots(s, n, hit, blocks) is None:
        return False
    s.num_computed_tokens += hit + n
    if s.num_computed_tokens == s.num_tokens:
        s.append_tokens(1)
    return True


def decode(m, s: Sequence, n: int) -> bool:
    """`advance`, with a decode token (one past the prompt, at rest) through `decode_slot` as the
    scheduler takes it: a new block is the pool's one-block take (`take_one`)."""
    if n == 1 and s.num_tokens - s.num_computed_tokens == 1 and s.num_computed_tokens >= s.num_prompt_tokens:
        got = m.decode_slot(s)
        if got is None:
            return False
        if got is not False:
            s.num_computed_tokens += 1
            s.append_tokens(1)
            return True
    return advance(m, s, n)


def drive_pair(counted, recorded, seed: int, requests: int, same, chunk: int | None = None, step=advance) -> None:
    """Random admits (shared prompts, equal answers), steps and frees on both managers, `same` of
    the two asserted after each: a prompt whole and a token a step (`step`), or with `chunk` at most
    that many tokens a step (chunked prefills)."""
    rng = random.Random(seed)
    live: dict[str, tuple[Sequence, Sequence]] = {}
    for uid in range(1, requests):
        action = rng.random()
        if action < 0.4 or not live:
            prompt = PROMPTS[rng.randrange(3)][: rng.randint(2, 30)]
            pair = tuple(Sequence(f"s{uid}", prompt, uid=uid, output=ANSWER) for _ in range(2))
            first = rng.randint(1, chunk) if chunk else None
            for m, s in zip((counted, recorded), pair, strict=True):
                blocks, hit = m.get_computed_blocks(s)
                n = s.num_tokens - hit
                if advance(m, s, n if first is None else min(n, first), hit, blocks):
                    live[s.seq_id] = pair
        elif action < 0.8:
            for m, s in zip((counted, recorded), live[rng.choice(sorted(live))], strict=True):
                step(m, s, 1 if chunk is None else max(1, min(s.num_tokens - s.num_computed_tokens, chunk)))
        else:
            for m, s in zip((counted, recorded), live.pop(rng.choice(sorted(live))), strict=True):
                m.free(s)
        same(counted, recorded)


def drive(policy: str, defrag: int | None, seed: int, step=advance) -> None:
    """`drive_pair` of two managers that differ only in `record_ops`: one state, consistent."""
    counted, recorded = (KVCacheManager(40, BS, eviction=policy, defrag_threshold=defrag, record_ops=rec)
                         for rec in (False, True))

    def same(a: KVCacheManager, b: KVCacheManager) -> None:
        assert state(a) == state(b)
        check(a)

    drive_pair(counted, recorded, seed, 200, same, step=step)


@pytest.mark.parametrize("policy", ["lru", "fifo", "lfu", "s3fifo", "cost", "pinned", "arc"])
@pytest.mark.parametrize("defrag", [None, 4])
def test_counted_paths_match_recorded(policy: str, defrag: int | None) -> None:
    for seed in range(3):
        drive(policy, defrag, seed)


@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
def test_a_decodes_one_block_take_matches_the_general_take(policy: str) -> None:
    """Decode tokens through `decode_slot`: with ops counted under exact LRU a new block is
    `BlockPool.take_one` (off the front stack, or the linked part's front, evicting its key), with
    them recorded `get_new_blocks(1)`; the states stay one."""
    for seed in range(6):
        drive(policy, None, seed, step=decode)


def hybrid_state(m: HybridKVCacheManager) -> tuple:
    pool = m.pool
    cached = cache_map(pool)
    free = pool.policy.queue.block_ids() if isinstance(pool.policy, LRU) else len(pool.policy)
    return ([{sid: m.block_ids(sid, g) for sid in m.block_tables} for g in range(m.num_groups)],
            [b.ref_cnt for b in pool.blocks[1:]], free, cached, pool.num_evictions, pool.num_free_blocks,
            m.held, m.peak, m.freed_behind, pool.evicted_by_group, m.id_space_fragmentation())


@pytest.mark.parametrize("policy", ["lru", "fifo", "s3fifo", "arc"])
def test_hybrid_counted_paths_match_recorded(policy: str) -> None:
    """The same over vLLM's hybrid groups (two windows and a full group, one pool): with ops only
    counted, the pool's one-pass takes and frees and the manager's counted allocation; with them
    recorded, the general paths, group by group (vllm/v1/core/kv_cache_coordinator.py
    `allocate_new_blocks`, each manager's in turn). Random chunked prefills, decodes and frees
    leave both in one state: tables by group, ref counts, the free order, the cache map, the
    groups' held, peak, freed-behind and evicted counts, and the id span."""
    groups = [GroupSpec("sliding_window", BS, 8), GroupSpec("full", BS), GroupSpec("sliding_window", BS, 8)]

    def same(a: HybridKVCacheManager, b: HybridKVCacheManager) -> None:
        assert hybrid_state(a) == hybrid_state(b)

    for seed in range(4):
        counted, recorded = (HybridKVCacheManager(60, groups, eviction=policy, record_ops=rec) for rec in (False, True))
        drive_pair(counted, recorded, seed, 150, same, chunk=12)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6), st.lists(st.integers(0, 9), min_size=6, max_size=6),
                          st.booleans()), max_size=12))
def test_caching_a_run_of_blocks_at_once_is_caching_them_one_by_one(plan: list) -> None:
    """`BlockPool.cache_blocks` over a run of blocks leaves the cache map, its keys in their order and
    each key's blocks in theirs, as caching the blocks one call each does: a key cached already, or
    twice in the run, maps to both blocks, a null block is skipped. Keys come from a small set, so
    repeats, within a run and against the map, are common. (A bulk pass for runs of fresh keys was
    tried against this and dropped: 126 ns a block against the loop's 116.)"""
    from kvsim.kvcache.block_pool import BlockPool

    pools = BlockPool(40), BlockPool(40)
    for i, (n, k, keys, null) in enumerate(plan):
        outs = []
        for j, pool in enumerate(pools):
            if len(pool.policy) < n:
                return
            blocks = pool.get_new_blocks(n)
            if null and n:
                blocks[0] = pool.null_block  # (a window's dropped block: skipped)
            ks = [100 * (i % 2) + x for x in keys]
            k = min(k, n)
            if j == 0:
                pool.cache_blocks(blocks, ks, 0, k)
            else:
                for a in range(k):
                    pool.cache_blocks(blocks, ks, a, a + 1)
            outs.append([b.block_hash for b in blocks])
        assert outs[0] == outs[1]
    a, b = ([(key, [hit.block_id] if type(hit) is KVCacheBlock else list(hit)) for key, hit in p.cached.items()]
            for p in pools)
    assert a == b


@pytest.mark.parametrize("policy", ["lru", "fifo", "s3fifo"])
def test_a_new_pool_frees_its_blocks_in_id_order_without_collecting(policy: str, monkeypatch) -> None:
    """Every block but the null one is free, first to be taken the lowest id (vLLM's
    `FreeKVCacheBlockQueue(self.blocks)` over ids 0..N-1, block 0 taken out as the null block:
    vllm/v1/core/block_pool.py `BlockPool.__init__`, 0.33.0). Under exact LRU only the null block is
    made with the pool, the others as they are first taken (`FreeBlockQueue.start_fresh`); under the
    other policies all are made at once, no cyclic collection running meanwhile, and the collector is
    left as it was."""
    import gc

    from kvsim.kvcache.block_pool import BlockPool
    from kvsim.kvcache.eviction import make_policy

    seen = []
    monkeypatch.setattr(KVCacheBlock, "__init__", _spy(KVCacheBlock.__init__, seen))
    for enabled in (True, False):
        (gc.enable if enabled else gc.disable)()
        try:
            chosen = make_policy(policy)
            seen.clear()  # (a queue's sentinels are blocks too)
            pool = BlockPool(9, policy=chosen)
            assert gc.isenabled() is enabled
        finally:
            gc.enable()
        if policy == "lru":
            assert (len(seen), len(pool.blocks), pool.num_free_blocks) == (1, 1, 8)
        else:
            assert len(seen) == 9 and not any(seen)  # the collector was off for every block made
        assert [b.block_id for b in pool.get_new_blocks(3)] == [1, 2, 3]
        assert len(pool.blocks) == (4 if policy == "lru" else 9)
        assert [b.block_id for b in pool.get_new_blocks(5)] == [4, 5, 6, 7, 8]
        assert [b.block_id for b in pool.blocks] == list(range(9)) and pool.num_free_blocks == 0


def test_fresh_blocks_keep_the_free_queue_order_of_blocks_made_at_once() -> None:
    """A pool whose blocks are made as first taken (exact LRU) against one whose queue starts with all
    of them made (the same LRU, every block pushed on the front stack at once, as the pool did before
    `start_fresh`): random takes (several, and one through `take_one`), frees at the front (uncached)
    and at the back (cached first), cache hits taken out of the queue, and walks of the queue's first
    blocks leave the two in one state after every operation: ids handed out, free count, cache map,
    ref counts, and at the end the whole free order. The lazy pool has made only the blocks handed out
    or walked past."""
    from kvsim.kvcache.block_pool import BlockPool

    def eager_pool(n: int) -> BlockPool:
        pool = BlockPool(n)
        q = pool.policy.queue
        q.num_free_blocks = q.num_fresh = 0
        pool.blocks = [pool.null_block] + [KVCacheBlock(i) for i in range(1, n)]
        q.prepend_n(pool.blocks[1:])
        return pool

    for seed in range(30):
        rng = random.Random(seed)
        n = rng.choice([5, 17, 64])
        pools = BlockPool(n), eager_pool(n)
        held: tuple[list[KVCacheBlock], list[KVCacheBlock]] = ([], [])
        walked, top = False, 0  # a walk of the queue yet; the highest id handed out
        for t in range(150):
            op, free = rng.random(), pools[0].num_free_blocks
            k, j, cache, w = rng.randint(1, max(free, 1)), rng.randrange(1 << 30), rng.random() < 0.5, rng.randint(1, 9)
            for pool, mine in zip(pools, held, strict=True):
                if op < 0.3 and free:
                    mine += pool.get_new_blocks(k)
                elif op < 0.45 and free:
                    mine.append(pool.take_one())
                elif op < 0.75 and mine:
                    b = mine.pop(j % len(mine))
                    if cache and b.block_hash is None and b.ref_cnt == 1:  # cached first: freed at the back
                        pool.cache_blocks([b], [1000 * t + b.block_id], 0, 1)
                    pool.free_blocks([b])
                elif op < 0.85 and pool.cached:
                    hit = pool.get_cached_block(sorted(pool.cached)[j % len(pool.cached)])
                    pool.touch([hit])
                    mine.append(hit)
                else:
                    walked = True
                    assert [b.block_id for b in itertools.islice(pool.policy.queue, w)] == \
                        pools[1].policy.queue.block_ids()[:w]
            assert [b.block_id for b in held[0]] == [b.block_id for b in held[1]]
            assert (pools[0].num_free_blocks, pools[0].num_cached_free, cache_map(pools[0])) == \
                (pools[1].num_free_blocks, pools[1].num_cached_free, cache_map(pools[1]))
            made = pools[0].blocks
            assert [b.ref_cnt for b in made] == [b.ref_cnt for b in pools[1].blocks[:len(made)]]
            assert [b.block_id for b in made] == list(range(len(made)))
            top = max([top] + [b.block_id for b in held[0]])
            if not walked:  # made: the null block and every id up to the highest handed out, no more
                assert len(made) == 1 + top
        assert pools[0].policy.queue.block_ids() == pools[1].policy.queue.block_ids()
        assert len(pools[0].blocks) == n  # the walk made the rest


def _spy(init, seen: list):
    import gc

    def spied(self, block_id: int) -> None:
        seen.append(gc.isenabled())
        init(self, block_id)

    return spied
