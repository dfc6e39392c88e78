"""The block manager's invariants, checked by the tests and the simulator's debug mode."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from kvsim.kvcache.block import KVCacheBlock
from kvsim.kvcache.eviction import LRU
from kvsim.kvcache.manager import KVCacheManager

if TYPE_CHECKING:
    from kvsim.kvcache.hybrid import HybridKVCacheManager


class InvariantError(AssertionError):
    """The manager's state is inconsistent; the message names the block."""


def check(m: KVCacheManager | HybridKVCacheManager) -> None:
    """Raise InvariantError unless every invariant of DESIGN.md holds:
    each block is free xor referenced (or pinned); ref counts equal the number of
    tables holding the block; the cached-hash map and the blocks agree; the
    free-queue links are consistent; the CPU pool's counts match swapped tables."""
    pool = m.pool
    null = pool.null_block
    holders: Counter[int] = Counter()
    # a hybrid manager (kvcache.hybrid) holds a table and a cached count a KV-cache group
    groups = zip(m.tables, m.num_cached, strict=True) if hasattr(m, "tables") else [(m.req_blocks, m.num_cached_block)]
    for tables, num_cached in groups:
        for sid, blocks in tables.items():
            for b in blocks:
                if b is not null:
                    holders[b.block_id] += 1
            if num_cached.get(sid, 0) > len(blocks):
                _fail(f"sequence {sid!r} has {len(blocks)} blocks but {num_cached[sid]} cached")
    policy = pool.policy
    num_free = 0
    cached_free = 0
    # the free queue's front stack (LRU's queue, a ranking policy's plain FIFO), as a set: `is_free`
    # searches it, which would make this walk quadratic
    queue = policy.queue if isinstance(policy, LRU) else getattr(policy, "plain", None)
    stacked = {b.block_id for b in queue.stack} if queue is not None else ()
    for b in pool.blocks[1:]:
        if b.ref_cnt != holders[b.block_id]:
            _fail(f"block {b.block_id}: ref count {b.ref_cnt}, held by {holders[b.block_id]} tables")
        free = b.block_id in stacked or policy.is_free(b)
        if b.ref_cnt > 0 and free:
            _fail(f"block {b.block_id}: free with ref count {b.ref_cnt}")
        pinned = policy.is_pinned(b)
        if b.ref_cnt == 0 and free == pinned:
            _fail(f"block {b.block_id}: unreferenced, free={free}, pinned={pinned}")
        num_free += free
        cached_free += free and b.block_hash is not None
        if b.block_hash is not None and _lookup(pool.cached.get(b.block_hash), b.block_id) is not b:
            _fail(f"block {b.block_id}: hash {b.block_hash} not mapped to it")
    num_free += queue.num_fresh if queue is not None else 0  # (free blocks not made yet)
    if num_free != pool.num_free_blocks:
        _fail(f"{num_free} free blocks, pool reports {pool.num_free_blocks}")
    if cached_free != pool.num_cached_free:
        _fail(f"{cached_free} cached free blocks, pool reports {pool.num_cached_free}")
    for key, hit in pool.cached.items():
        for b in [hit] if type(hit) is KVCacheBlock else hit.values():
            if b.block_hash != key:
                _fail(f"hash map: key {key} -> block {b.block_id} whose hash is {b.block_hash}")
    if isinstance(policy, LRU):
        _check_links(policy)
    if pool.tracker is not None:
        used = [b.block_id for b in pool.blocks[1:] if b.ref_cnt > 0]
        if pool.tracker.num_used() != len(used):
            _fail(f"id tracker counts {pool.tracker.num_used()} used blocks, pool has {len(used)}")
        if getattr(m, "defrag", None) is None and pool.tracker.max_used() != max(used, default=0):
            _fail(f"id tracker's highest used id is {pool.tracker.max_used()}, pool's is {max(used, default=0)}")
    if not hasattr(m, "cpu"):  # (a hybrid manager swaps nothing)
        return
    cpu_holders: Counter[int] = Counter(c for ids in m.swapped.values() for c in ids if c >= 0)
    for c in range(m.cpu.num_blocks):
        if m.cpu.ref[c] != cpu_holders[c]:
            _fail(f"CPU block {c}: ref count {m.cpu.ref[c]}, held by {cpu_holders[c]} swapped tables")


def _lookup(hit, block_id: int):
    if hit is None or type(hit) is KVCacheBlock:
        return hit
    return hit.get(block_id)


def _check_links(policy: LRU) -> None:
    q = policy.queue
    ids = [b.block_id for b in q.stack]
    if len(set(ids)) != len(ids):
        _fail("free queue: a block twice on its front stack")
    for b in q.stack:
        if b.prev is not None or b.next is not None or b.block_hash is not None:
            _fail(f"free queue: block {b.block_id} on the front stack is linked or cached")
    prev = q._head
    n = len(q.stack) + q.num_fresh
    b = q._head.next
    while b is not q._tail:
        if b.prev is not prev:
            _fail(f"free queue: block {b.block_id} has a broken back link")
        prev = b
        b = b.next
        n += 1
        if n > q.num_free_blocks:
            _fail("free queue: longer than its count (cycle?)")
    if n != q.num_free_blocks or q._tail.prev is not prev:
        _fail(f"free queue: walked {n} blocks, count says {q.num_free_blocks}")


def _fail(msg: str) -> None:
    raise InvariantError(msg)
