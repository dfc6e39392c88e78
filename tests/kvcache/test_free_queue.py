"""The free-block queue's two parts (a front stack, then linked blocks) keep exactly one list's order.

vLLM V1's `FreeKVCacheBlockQueue` (vllm/v1/core/kv_cache_utils.py) is one doubly linked list: pops
from the front, cached frees appended, and from vLLM 0.24 uncached frees prepended
(`BlockPool.free_blocks`). kvsim keeps blocks put at the front on a Python list so runs of them move
by slicing; these tests pin that the order is the one list's, whatever the mix of operations.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsim.kvcache.block import KVCacheBlock
from kvsim.kvcache.free_queue import FreeBlockQueue

N = 12


def _ids(q: FreeBlockQueue) -> list[int]:
    return q.block_ids()


def test_the_blocks_it_starts_with_are_reused_in_their_order():
    blocks = [KVCacheBlock(i) for i in range(1, 6)]
    q = FreeBlockQueue(blocks)
    assert _ids(q) == [1, 2, 3, 4, 5]
    assert [b.block_id for b in q.popleft_n(2)] == [1, 2]
    assert q.popleft().block_id == 3
    assert len(q) == 2


def test_front_then_linked_then_back():
    b = [KVCacheBlock(i) for i in range(10)]
    q = FreeBlockQueue(b[1:3])            # [1, 2] on the stack
    q.append_n([b[5], b[6]])              # linked at the back: [1, 2, 5, 6]
    q.prepend_n([b[7], b[8]])             # uncached frees to the front: [7, 8, 1, 2, 5, 6]
    q.push_front_reversed([b[3], b[4]])   # the last of them first: [4, 3, 7, 8, 1, 2, 5, 6]
    assert _ids(q) == [4, 3, 7, 8, 1, 2, 5, 6]
    q.remove(b[8])                        # off the stack
    q.remove(b[5])                        # unlinked
    assert _ids(q) == [4, 3, 7, 1, 2, 6]
    assert [x.block_id for x in q.pop_stack(10)] == [4, 3, 7, 1, 2]  # the stack only
    assert _ids(q) == [6] and len(q) == 1
    with pytest.raises(ValueError, match="block 8 is not in the free queue"):
        q.remove(b[8])


op = st.one_of(
    st.tuples(st.just("pop"), st.integers(0, N)),
    st.tuples(st.just("popleft"), st.just(0)),
    st.tuples(st.just("stack"), st.integers(0, N)),
    st.tuples(st.just("append"), st.integers(0, 4)),
    st.tuples(st.just("prepend"), st.integers(0, 4)),
    st.tuples(st.just("push"), st.integers(0, 4)),
    st.tuples(st.just("remove"), st.integers(0, N)),
)


@settings(max_examples=300, deadline=None)
@given(start=st.integers(0, N), ops=st.lists(op, max_size=40))
def test_any_mix_of_operations_keeps_one_lists_order(start, ops):
    blocks = [KVCacheBlock(i) for i in range(N)]
    q = FreeBlockQueue(blocks[:start])
    ref = list(range(start))                 # the one list vLLM keeps
    out = list(range(start, N))              # blocks not in the queue
    for kind, k in ops:
        if kind in ("pop", "stack", "popleft"):
            if kind == "popleft":
                if not ref:
                    continue
                got = [q.popleft().block_id]
            elif kind == "pop":
                k = min(k, len(ref))
                got = [b.block_id for b in q.popleft_n(k)]
            else:
                got = [b.block_id for b in q.pop_stack(k)]
            assert got == ref[:len(got)]
            del ref[:len(got)]
            out += got
        elif kind == "remove":
            if ref:
                victim = ref.pop(k % len(ref))
                q.remove(blocks[victim])
                out.append(victim)
        else:
            moved, out = out[:k], out[k:]
            if kind == "append":
                q.append_n([blocks[i] for i in moved])
                ref += moved
            elif kind == "prepend":
                q.prepend_n([blocks[i] for i in moved])
                ref[:0] = moved
            else:
                q.push_front_reversed([blocks[i] for i in moved])
                ref[:0] = moved[::-1]
        assert _ids(q) == ref
        assert len(q) == len(ref)


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 10_000), n_runs=st.integers(1, 4), tracked=st.booleans())
def test_free_runs_is_free_blocks_of_each_run_in_turn(seed, n_runs, tracked):
    """`BlockPool.free_runs` (the hybrid manager's windows letting blocks go, group by group: vLLM's
    `KVCacheCoordinator.remove_skipped_blocks` calls each group's manager, which calls
    `BlockPool.free_blocks`) leaves the pool as separate `free_blocks` calls would: the same free
    order, ref counts, counts and id span, and the same blocks freed per run."""
    import random

    from kvsim.kvcache.block_pool import BlockPool
    from kvsim.kvcache.id_span import IdSpan

    def build():
        pool = BlockPool(40)
        if tracked:
            pool.tracker = IdSpan(pool.blocks)
        return pool

    rng = random.Random(seed)
    pools = build(), build()
    plan = []  # (take n, cache the first k of them, share the first s with a second reference)
    for _ in range(n_runs):
        n = rng.randint(0, 8)
        plan.append((n, rng.randint(0, n), rng.randint(0, n)))
    runs_of = []
    for pool in pools:
        runs = []
        for i, (n, k, shared) in enumerate(plan):
            blocks = pool.get_new_blocks(n)
            pool.cache_blocks(blocks, [1000 * i + j for j in range(n)], 0, k)
            pool.touch(blocks[:shared])  # a second holder: those stay used
            runs.append(blocks[::-1] + [pool.null_block])
        runs_of.append(runs)
    fused = pools[0].free_runs(runs_of[0])
    one_by_one = []
    for run in runs_of[1]:
        before = pools[1].num_free_blocks
        pools[1].free_blocks(run)
        one_by_one.append(pools[1].num_free_blocks - before)
    a, b = pools
    assert fused == one_by_one == [n - shared for n, _, shared in plan]
    assert a.policy.queue.block_ids() == b.policy.queue.block_ids()
    assert [x.ref_cnt for x in a.blocks] == [x.ref_cnt for x in b.blocks]
    assert (a.num_free_blocks, a.num_cached_free, a.ops.counts) == (b.num_free_blocks, b.num_cached_free, b.ops.counts)
    if tracked:
        assert (a.tracker.num_used(), a.tracker.max_used()) == (b.tracker.num_used(), b.tracker.max_used())
