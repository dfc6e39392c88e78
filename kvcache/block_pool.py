"""The block pool: allocate, free, touch, cache and evict GPU blocks.

Block 0 is the null block, as in vLLM V1: it is never allocated, so
`num_blocks = N` gives N - 1 usable blocks. Cached keys map to blocks; a key
may map to several blocks (two requests that filled identical blocks at the
same time), and lookup returns the one registered first.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from operator import attrgetter

from kvsim.kvcache.block import KVCacheBlock
from kvsim.kvcache.events import KVEventLog
from kvsim.kvcache.eviction import LRU, EvictionPolicy
from kvsim.kvcache.eviction.base import overrides
from kvsim.kvcache.id_span import IdSpan
from kvsim.kvcache.ops import OpLog

_ref_cnt = attrgetter("ref_cnt")


class OutOfBlocksError(RuntimeError):
    """Raised when more blocks are asked for than are free."""


BYTES_PER_BLOCK = 128  # this process's memory for one block (its object, the free queue's links, the id span)


def available_memory() -> int | None:
    """Bytes this machine can still give a process (Linux MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_memory(num_blocks: int, field: str = "num_gpu_blocks") -> None:
    """Refuse, before any is made, a pool whose blocks would not fit in this machine's memory
    (ValueError naming `field`, the bytes it needs and those available)."""
    need, have = num_blocks * BYTES_PER_BLOCK, available_memory()
    if have is not None and need > have:
        raise ValueError(f"{field} {num_blocks:,}: the simulated pool needs about {need / 1e9:,.1f} GB of this "
                         f"machine's memory ({BYTES_PER_BLOCK} bytes a block) and {have / 1e9:,.1f} GB is available")


@contextmanager
def collections_paused() -> Iterator[None]:
    """No cyclic garbage collection while a pool's blocks are made: each block is a tracked object,
    and the collections their allocation would start scan every tracked object in the process, the
    other replicas' blocks among them (a 16-replica cluster of 27,000-block pools spent about a third
    of a short run in them). Making blocks makes no garbage. The previous state is restored after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class BlockPool:
    """GPU blocks with ref counts, the prefix-cache map and the eviction policy."""

    def __init__(self, num_blocks: int, *, enable_caching: bool = True,
                 policy: EvictionPolicy | None = None, ops: OpLog | None = None,
                 free_first: bool = True):
        if num_blocks < 2:
            raise ValueError(f"num_gpu_blocks must be at least 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.free_first = free_first  # uncached freed blocks go to the front (vLLM 0.24+)
        self.policy = policy if policy is not None else LRU()
        self.policy.bind(num_blocks)
        # `blocks`: the blocks made so far, by id; under exact LRU the queue starts as fresh blocks,
        # each made (appended here) when first taken (`FreeBlockQueue.start_fresh`)
        if type(self.policy) is LRU:
            self.blocks = [KVCacheBlock(0)]
            self.policy.queue.start_fresh(self.blocks, num_blocks - 1)
        else:
            with collections_paused():
                self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
                self.policy.free(self.blocks[1:])
        self.null_block = self.blocks[0]
        self.cached: dict[int, KVCacheBlock | dict[int, KVCacheBlock]] = {}
        self.ops = ops if ops is not None else OpLog()
        self.num_evictions = 0
        self.num_cached_free = 0  # free blocks that still hold a cached prefix
        self.tracker = None  # an IdSpan or Defragmenter, told of every block becoming used / unused
        # several KV-cache groups (kvcache.hybrid): each block's group (set by the manager as it takes
        # blocks) and the cached blocks each group lost to eviction
        self.group_of: list[int] | None = None
        self.evicted_by_group: list[int] | None = None
        self.events: KVEventLog | None = None  # vLLM's KV events, when asked for (`kvcache.events`)
        # hooks the policy leaves as no-ops are not called from the hot loops
        self._on_cache = self.policy.on_cache if overrides(self.policy, "on_cache") else None
        self._on_hit = self.policy.on_hit if overrides(self.policy, "on_hit") else None
        self._on_evict = self.policy.on_evict if overrides(self.policy, "on_evict") else None
        self._pins = overrides(self.policy, "is_pinned")
        # exact LRU: its queue popped and the blocks taken in one pass (`_pop_counted`)
        self._lru = self.policy.queue if type(self.policy) is LRU else None

    @property
    def num_free_blocks(self) -> int:
        return len(self.policy)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def policy_sees_caching(self) -> bool:
        """True if the eviction policy hooks blocks being cached: when and in what order
        blocks are cached is then part of its state (FIFO's birth order, ARC's ghosts)."""
        return self._on_cache is not None

    def get_cached_block(self, key: int) -> KVCacheBlock | None:
        hit = self.cached.get(key)
        if hit is None or type(hit) is KVCacheBlock:
            return hit
        return next(iter(hit.values()))

    def num_free_hits(self, hits: list[KVCacheBlock], nulls: bool = False) -> int:
        """How many of the cache-hit blocks `hits` sit in the free set (so taking them consumes
        it); `nulls`: the list may hold the null block (a sliding window's hit)."""
        if nulls or self._pins:
            null, pinned = self.null_block, self.policy.is_pinned if self._pins else None
            return sum(1 for b in hits if b.ref_cnt == 0 and b is not null and not (pinned and pinned(b)))
        return list(map(_ref_cnt, hits)).count(0)

    def get_new_blocks(self, n: int, keys: list[int | None] | None = None) -> list[KVCacheBlock]:
        """Pop `n` blocks for writing; a popped cached block is evicted. With `keys`, each popped
        block's key (None: uncached) is appended to it and the evictions are neither recorded nor
        counted as ops: the caller records each where its block is used (`decode_in_place`)."""
        if n > len(self.policy):
            raise OutOfBlocksError(f"asked for {n} blocks, only {len(self.policy)} free")
        plain = self._on_evict is None and self.events is None  # no hook to tell of each eviction
        one_pass = self._on_evict is None and self._lru is not None  # exact LRU: `_pop_counted`
        if one_pass and plain and (keys is not None or not self.ops.enabled):
            return self._pop_counted(n, keys)
        if one_pass and keys is None:
            # op records or KV events: the one-pass take, its evictions recorded (and each queued as
            # a `BlockRemoved`, in pop order) after it: no hook runs between
            keys = []
            out = self._pop_counted(n, keys)
            if len(keys) - keys.count(None):
                evicted = [b.block_id for b, key in zip(out, keys, strict=True) if key is not None]
                gone = [key for key in keys if key is not None]
                if self.ops.enabled:
                    self.ops.emit_evicts(evicted, gone)
                else:
                    self.ops.counts["evict"] += len(evicted)
                if self.events is not None:
                    self.events.removed_keys(evicted, gone, self.group_of)
            return out
        if plain and keys is None and not self.ops.enabled:
            return self._take_counted(self.policy.pop_n(n))
        blocks = self.policy.pop_n(n)
        if keys is not None:
            keys += [b.block_hash for b in blocks]
        evicted = []
        for b in blocks:
            if b.ref_cnt:
                raise AssertionError(f"free block {b.block_id} has ref count {b.ref_cnt}")
            if b.block_hash is not None:
                evicted.append(b)
            b.ref_cnt = 1
        if evicted:
            if keys is None:  # (with `keys` the caller records and counts them)
                if self.ops.enabled:
                    self.ops.emit_evicts([b.block_id for b in evicted], [b.block_hash for b in evicted])
                else:
                    self.ops.counts["evict"] += len(evicted)
            eg = self.evicted_by_group
            if self.events is not None:  # (before their keys go)
                self.events.removed(evicted, self.group_of)
            for b in evicted:
                if eg is not None:
                    eg[b.group] += 1
                self._evict(b)
            self.num_evictions += len(evicted)
            self.num_cached_free -= len(evicted)
        if self.tracker is not None:
            self.tracker.use_distinct([b.block_id for b in blocks])
        return blocks

    def _pop_counted(self, n: int, keys: list[int | None] | None = None) -> list[KVCacheBlock]:
        """`_take_counted(LRU.pop_n(n))` in one pass: the queue's front stack first, taken by
        slicing (the pool puts only uncached blocks there, so nothing is evicted), then its linked
        part, block by block. `keys`: as `get_new_blocks` takes it (the evictions not counted as ops)."""
        q = self._lru
        out = q.pop_stack(n)
        if keys is not None:
            keys += [None] * len(out)
        top = 0
        for b in out:  # (one plain loop: an attrgetter map a field costs more than all three)
            if b.block_hash is not None:
                raise AssertionError("a cached block was at the front of the free queue")
            b.ref_cnt = 1
            i = b.block_id
            if i > top:
                top = i
        rest = n - len(out)
        if not rest:
            self._taken(out, 0, top)
            return out
        block = q.front()
        pop, evicted = self.cached.pop, 0
        groups = [] if self.evicted_by_group is not None else None  # each eviction's group, counted after
        for _ in range(rest):
            b = block
            block = b.next
            b.prev = b.next = None
            key = b.block_hash
            if key is not None:
                hit = pop(key)  # (one lookup: a key shared with other blocks goes back without this one)
                if hit is not b:
                    self._unshare(key, hit, b)
                b.block_hash = None
                evicted += 1
                if groups is not None:
                    groups.append(b.group)
            if keys is not None:
                keys.append(key)
            b.ref_cnt = 1
            if b.block_id > top:
                top = b.block_id
            out.append(b)
        q.detach_front(block, rest)
        if groups:
            self._count_groups(groups)
        self._taken(out, evicted, top, keys is None)
        return out

    def take_one(self) -> KVCacheBlock:
        """`get_new_blocks(1)[0]`: a decode's new block, the common take, in one pass where the
        counted take applies (exact LRU, no eviction hook, no KV events, ops counted)."""
        q = self._lru
        if q is None or self._on_evict is not None or self.events is not None or self.ops.enabled \
                or not q.num_free_blocks:
            return self.get_new_blocks(1)[0]
        stack = q.stack
        if stack or q.num_fresh:  # (as `_pop_counted`: the front stack holds no cached block)
            if not stack:
                q.unfresh(1)
            b = stack.pop()
            q.num_free_blocks -= 1
            if b.block_hash is not None:
                raise AssertionError("a cached block was at the front of the free queue")
            evicted = 0
        else:
            b = q.front()
            nxt = b.next
            b.prev = b.next = None
            q.detach_front(nxt, 1)
            evicted = 0
            if b.block_hash is not None:
                self._evict(b)
                evicted = 1
                if self.evicted_by_group is not None:
                    self.evicted_by_group[b.group] += 1
        b.ref_cnt = 1
        self._taken((b,), evicted, b.block_id)
        return b

    def _count_groups(self, groups: list[int]) -> None:
        """Count evictions for the groups `groups` names, one entry an evicted block."""
        eg = self.evicted_by_group
        for g in range(len(eg)):
            eg[g] += groups.count(g)

    def _take_counted(self, blocks: list[KVCacheBlock]) -> list[KVCacheBlock]:
        """`get_new_blocks` when ops are only counted and the policy has no eviction hook: the
        same effects in one pass (each popped block's key dropped in pop order)."""
        pop, evicted, top = self.cached.pop, 0, 0
        groups = [] if self.evicted_by_group is not None else None  # each eviction's group, counted after
        for b in blocks:
            if b.ref_cnt:
                raise AssertionError(f"free block {b.block_id} has ref count {b.ref_cnt}")
            key = b.block_hash
            if key is not None:
                hit = pop(key)
                if hit is not b:
                    self._unshare(key, hit, b)
                b.block_hash = None
                evicted += 1
                if groups is not None:
                    groups.append(b.group)
            b.ref_cnt = 1
            if b.block_id > top:
                top = b.block_id
        if groups:
            self._count_groups(groups)
        self._taken(blocks, evicted, top)
        return blocks

    def _taken(self, blocks: list[KVCacheBlock], evicted: int, top: int, count_ops: bool = True) -> None:
        """The counted takes' end: `evicted` of `blocks` were evictions (counted as ops unless the
        caller records them); the tracker told (an IdSpan keeps just the count and `top`, the
        highest id taken)."""
        if evicted:
            if count_ops:
                self.ops.counts["evict"] += evicted
            self.num_evictions += evicted
            self.num_cached_free -= evicted
        tracker = self.tracker
        if tracker is not None and blocks:
            if type(tracker) is IdSpan:
                tracker.use(len(blocks), top)
            else:
                tracker.use_distinct([b.block_id for b in blocks])

    def _unshare(self, key: int, hit: dict[int, KVCacheBlock], block: KVCacheBlock) -> None:
        """`key`'s entry `hit`, just popped from the cache map, was the blocks sharing it (by id):
        put back the others without `block`, in their order, one alone as itself."""
        del hit[block.block_id]
        self.cached[key] = next(iter(hit.values())) if len(hit) == 1 else hit

    def _evict(self, block: KVCacheBlock) -> None:
        """Drop a reused block's key from the cache map (counted by the caller)."""
        key = block.block_hash
        hit = self.cached.pop(key)  # (one lookup, as the counted takes do)
        if hit is not block:
            self._unshare(key, hit, block)
        if self._on_evict is not None:
            self._on_evict(block)
        block.block_hash = None

    def uncache(self, block: KVCacheBlock) -> None:
        """Drop a held block's key from the cache map, not counted as an eviction (vLLM's
        `BlockPool._maybe_evict_cached_block` for a Mamba checkpoint that held a transient state)."""
        if block.block_hash is not None:
            if self.events is not None:
                self.events.removed([block], self.group_of)
            self._evict(block)

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the free set."""
        remove, pinned = self.policy.remove, self.policy.is_pinned if self._pins else None
        on_hit, null = self._on_hit, self.null_block
        used = []  # ids of the free blocks taken
        for b in blocks:
            if b.ref_cnt == 0 and b is not null:
                if pinned is None or not pinned(b):
                    remove(b)
                    self.num_cached_free -= 1
                used.append(b.block_id)
            b.ref_cnt += 1
            if on_hit is not None:
                on_hit(b)
        if used and self.tracker is not None:
            self.tracker.use_distinct(used)

    def free_blocks(self, ordered: list[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching 0 join the free set in this order:
        with `free_first`, uncached ones at the front, cached ones at the back."""
        if self._counted_frees():
            if self._lru is not None:
                self._free_lru([ordered])
            else:
                self._free_counted(ordered)
            return
        if self._lru is not None and self._counted_frees(recorded=True):
            # op records: the one-pass free, then a `free` row a block that reached 0, in order (a
            # table holds a block once, and only those are at 0 now)
            self._free_lru([ordered], count_ops=False)
            null = self.null_block
            freed = [b.block_id for b in ordered if not b.ref_cnt and b is not null]
            if freed:
                self.ops.emit_free(freed)
            return
        freed = []  # reaching 0, in order
        first = []  # of those, the ones to reuse first (uncached, with free_first)
        later = []  # of those, the cached ones (to the back, with free_first)
        null, pinned = self.null_block, self.policy.is_pinned if self._pins else None
        for b in ordered:
            if b is null:
                continue
            rc = b.ref_cnt - 1
            if rc < 0:
                raise ValueError(f"double free of block {b.block_id}")
            b.ref_cnt = rc
            if not rc:
                freed.append(b)
                if b.block_hash is None:
                    first.append(b)
                else:
                    later.append(b)
        self.num_cached_free += len(later) if pinned is None else sum(1 for b in later if not pinned(b))
        if not freed:
            return
        if self.ops.enabled:
            self.ops.emit_free([b.block_id for b in freed])
        else:
            self.ops.counts["free"] += len(freed)
        if self.tracker is not None:
            self.tracker.release_distinct([b.block_id for b in freed])
        if not self.free_first or not first:
            self.policy.free(freed)
        elif len(first) == len(freed):
            self.policy.free_first(freed)
        else:
            self.policy.free_first(first)
            self.policy.free(later)

    def _counted_frees(self, recorded: bool = False) -> bool:
        """Whether a free may take the counted paths: `free_first`, no pins, ops only counted (or,
        `recorded`, recorded), no tracker but an IdSpan (which needs only the number freed and the
        blocks given)."""
        return self.free_first and not self._pins and self.ops.enabled == recorded \
            and (self.tracker is None or type(self.tracker) is IdSpan)

    def free_runs(self, runs: list[list[KVCacheBlock]]) -> list[int]:
        """`free_blocks` of each run in turn (several KV-cache groups' blocks let go together, as
        vLLM's coordinator frees them group by group); returns how many blocks of each run joined
        the free set (under exact LRU in one pass, `_free_lru`)."""
        if self._lru is not None and self._counted_frees():
            return self._free_lru(runs)
        counts = []
        for run in runs:
            before = len(self.policy)
            self.free_blocks(run)
            counts.append(len(self.policy) - before)
        return counts

    def _free_lru(self, runs: list[list[KVCacheBlock]], count_ops: bool = True) -> list[int]:
        """`_free_counted` of each run in turn under exact LRU, in one pass: the uncached blocks
        reaching 0 are gathered for the queue's front stack (each run's after the run before it, the
        first freed of a run ending first: so the last run's are reused first, as separate calls
        leave them), the cached ones linked into one chain for its back in run order, as
        `prepend_n` and `append_n` would put them. Returns how many of each run were freed."""
        null, tracker = self.null_block, self.tracker
        front: list[KVCacheBlock] = []
        l_head = l_tail = None
        nl = 0
        counts = []
        for run in runs:
            first = []
            nl_before = nl
            for b in run:
                if b is null:
                    continue
                rc = b.ref_cnt - 1
                if rc:
                    if rc < 0:
                        raise ValueError(f"double free of block {b.block_id}")
                    b.ref_cnt = rc
                    continue
                b.ref_cnt = 0
                if b.block_hash is None:
                    first.append(b)
                else:
                    if l_tail is None:
                        l_head = b
                    else:
                        l_tail.next = b
                        b.prev = l_tail
                    l_tail = b
                    nl += 1
            n = len(first) + nl - nl_before
            counts.append(n)
            if first:
                first.reverse()
                front += first
            if n and tracker is not None:
                tracker.release(n, run)
        if front:  # in front, each run's in its order (prepend_n)
            self._lru.push_front_reversed(front)
        if nl:  # at the back, in their order (append_n)
            self._lru.splice_back(l_head, l_tail, nl)
        self.num_cached_free += nl
        if count_ops:  # (else the caller records them)
            self.ops.counts["free"] += len(front) + nl
        return counts

    def _free_counted(self, ordered: list[KVCacheBlock]) -> None:
        """`free_blocks` with `free_first`, no pins, ops only counted and no tracker but an IdSpan:
        one pass that builds just the two lists the policy needs, no list of all freed blocks
        (an IdSpan needs only their number and `ordered`)."""
        null, first, later = self.null_block, [], []
        for b in ordered:
            if b is null:
                continue
            rc = b.ref_cnt - 1
            if rc:
                if rc < 0:
                    raise ValueError(f"double free of block {b.block_id}")
                b.ref_cnt = rc
            else:
                b.ref_cnt = 0
                if b.block_hash is None:
                    first.append(b)
                else:
                    later.append(b)
        n_freed = len(first) + len(later)
        if not n_freed:
            return
        self.num_cached_free += len(later)
        self.ops.counts["free"] += n_freed
        if self.tracker is not None:
            self.tracker.release(n_freed, ordered)
        # NOTE: the same calls `free_blocks` makes: only `first`, only `later`, or both in this order
        if first:
            self.policy.free_first(first)
        if later:
            self.policy.free(later)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, as vLLM's `BlockPool.reset_prefix_cache`: only when no
        block is in use (returns False and changes nothing otherwise). Free blocks keep
        their place in the free set."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        ranked = None if isinstance(self.policy, LRU) else self.policy.pop_n(len(self.policy))
        for b in self.blocks:
            if b.block_hash is not None:
                if self.ops.enabled:
                    self.ops.emit("evict", b.block_id, h=b.block_hash)
                else:
                    self.ops.counts["evict"] += 1
                if self._on_evict is not None:
                    self._on_evict(b)
                b.block_hash = None
        self.cached.clear()
        self.num_cached_free = 0
        if self.events is not None:
            self.events.cleared()
        if ranked is not None:  # a ranking policy holds hash-less blocks in its plain FIFO
            self.policy.free(ranked)
        return True

    def cache_blocks(self, blocks: list[KVCacheBlock], keys: list[int], start: int, end: int,
                     chain: int = 0, salt: int = 0, group: int | None = None) -> None:
        """Register just-filled `blocks[start:end]` under `keys[start:end]` (null blocks skipped),
        each XORed with `salt` (a KV-cache group's, `groups.group_salt`); `chain` is the caching
        sequence's prompt length in blocks; `group`: the KV-cache group an eviction of them is
        counted for (several groups: `KVCacheBlock.group`, and `group_of` where op records or KV
        events name an evicted block's group)."""
        cached = self.cached
        null = self.null_block
        on_cache = self._on_cache
        go = self.group_of if group is not None and (self.ops.enabled or self.events is not None) else None
        for i in range(start, end):
            b = blocks[i]
            if b is null:
                continue
            if b.block_hash is not None:
                raise AssertionError(f"block {b.block_id} is already cached")
            if group is not None:
                b.group = group
                if go is not None:
                    go[b.block_id] = group
            key = keys[i] ^ salt if salt else keys[i]  # (group 0's salt is 0: no new int)
            b.block_hash = key
            if key in cached:  # cached already: it maps to both
                self._cache_again(key, b)
            else:
                cached[key] = b
            if on_cache is not None:
                on_cache(b, i, chain)

    def _cache_again(self, key: int, block: KVCacheBlock) -> None:
        """Map an already cached `key` to `block` too (lookup keeps returning the first)."""
        hit = self.cached[key]
        if type(hit) is KVCacheBlock:
            self.cached[key] = {hit.block_id: hit, block.block_id: block}
        else:
            hit[block.block_id] = block
