"""ARC (Megiddo & Modha, FAST'03) on hand-worked sequences of one-block prompts.

Asked for in vLLM issue #40268; vLLM 0.33 offers ARC for CPU offloading as
`ARCCachePolicy` in vllm/v1/kv_offload/cpu/policies/arc.py. Ours follows the
paper where they differ: a ghost hit is cached straight into T2.
"""

from kvsim.kvcache.eviction import ARC, POLICIES, check_policy, make_policy
from kvsim.kvcache.invariants import check
from kvsim.kvcache.manager import KVCacheManager
from tests.kvcache.conftest import prefill, seq

A, B, C, D, E = (list(range(100 * i, 100 * i + 4)) for i in range(5))


def key(tokens: list[int]) -> int:
    return seq("k", tokens).hashes_upto(4, 4)[0]


def cache(m: KVCacheManager, tokens: list[int], uid: int) -> None:
    """Prefill a one-block prompt and finish it: its block is cached and free."""
    s = seq(f"p{uid}", tokens, uid=uid)
    prefill(m, s)
    m.free(s)


def hit(m: KVCacheManager, tokens: list[int], uid: int) -> None:
    """A request that hits the cached block of `tokens`, allocates nothing, and finishes."""
    s = seq(f"h{uid}", tokens + [7], uid=uid)
    blocks, n = m.get_computed_blocks(s)
    assert n == 4
    assert m.allocate_slots(s, 0, n, blocks) == []
    m.free(s)


def cached(m: KVCacheManager, *prompts: list[int]) -> list[bool]:
    return [m.pool.get_cached_block(key(p)) is not None for p in prompts]


def test_arc_keeps_a_hit_block_that_lru_evicts():
    # A is cached and hit, then B, C, D are cached once; a 3-block request comes.
    # LRU's queue is [5, A, B, C, D] (A was freed before B): it reuses 5, A, B.
    # ARC holds A in T2 and B, C, D in T1; with p = 0 it takes 5, then B and C.
    survivors = {}
    for policy in ("lru", "arc"):
        m = KVCacheManager(6, 4, eviction=policy)
        cache(m, A, 0)
        hit(m, A, 1)
        for uid, p in enumerate((B, C, D), start=2):
            cache(m, p, uid)
        prefill(m, seq("new", range(1000, 1012), uid=9))
        check(m)
        survivors[policy] = cached(m, A, B, C, D)
    assert survivors == {"lru": [False, False, True, True], "arc": [True, False, False, True]}


def test_ghost_hits_move_the_target_and_the_victim():
    m = KVCacheManager(4, 4, eviction="arc")  # c = 3 usable blocks
    arc = m.pool.policy
    cache(m, A, 0)
    hit(m, A, 1)  # A: T2
    cache(m, B, 2)
    cache(m, C, 3)  # T1 = [B, C], no free uncached block left
    cache(m, D, 4)  # evicts B (T1's LRU, |T1| = 2 > p = 0): B1 = [B]
    assert (list(arc.b1), list(arc.b2), arc.p) == ([key(B)], [], 0.0)
    cache(m, B, 5)  # evicts C; B is a B1 ghost: p += max(1, |B2|/|B1| = 0/2), B goes to T2
    assert (list(arc.b1), list(arc.b2), arc.p) == ([key(C)], [], 1.0)
    assert (arc.n1, arc.n2, [b.block_id for b in arc.t1.values()], list(arc.t2)) == (1, 2, [2], [1, 3])
    cache(m, E, 6)  # |T1| = 1 <= p: the victim is T2's LRU, A, though T1 holds D
    assert cached(m, A, B, C, D, E) == [False, True, False, True, True]
    assert (list(arc.b1), list(arc.b2)) == ([key(C)], [key(A)])
    cache(m, A, 7)  # evicts D (|T1| = 2 > p); A is a B2 ghost: p -= max(1, |B1|/|B2| = 2/1)
    assert (list(arc.b1), list(arc.b2), arc.p) == ([key(C), key(D)], [], 0.0)
    assert cached(m, A, B, C, D, E) == [True, True, False, False, True]
    check(m)


def test_ghost_directory_is_bounded_by_capacity():
    # every block is in T1 and the cache is full: |T1| + |B1| <= c leaves no ghost
    m = KVCacheManager(4, 4, eviction="arc")
    for uid, p in enumerate((A, B, C, D, E)):
        cache(m, p, uid)
    assert (m.pool.policy.n1, list(m.pool.policy.b1)) == (3, [])
    cache(m, A, 5)  # not remembered: no adaptation
    assert m.pool.policy.p == 0.0
    assert cached(m, A, B, C, D, E) == [True, False, False, True, True]


def test_arc_is_registered_and_drives_the_manager():
    check_policy("arc")
    assert POLICIES["arc"] is ARC
    assert isinstance(make_policy("arc"), ARC)
    m = KVCacheManager(6, 4, eviction="arc")
    assert isinstance(m.pool.policy, ARC)
    assert m.pool.policy.capacity == 5
    cache(m, A, 0)
    s = seq("again", A + [7], uid=1)
    assert m.get_computed_blocks(s)[1] == 4
    assert m.pool.num_free_blocks == 5
    check(m)
