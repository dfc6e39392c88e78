"""The scheduler's exact speed shortcuts, all behind one switch (`SimConfig.shortcuts`).

- Lazy decodes: a running sequence whose decode token lands mid-block in an
  unshared block needs no block, copy or cache entry, so nothing about it
  changes but its token counts until its block is nearly full; it is counted
  each step, not visited. A lazy sequence's `seq` lags: it holds the state at
  the step it went lazy (`since`), and every later step adds one computed and
  one sampled token. The batch totals over lazy sequences are linear in the
  step number k, so they are kept as sums (a block filling at step k holds no
  empty slot, not -1: `_fills`). A block that holds a unique decoded token
  (past the known tokens) may fill lazily (`LazyDecodes.fills`): nothing can
  look its key up while its sequence holds it, so it is cached when the
  sequence's blocks are freed or swapped out (`Shortcuts.free`, `preempted`), or
  when a later block of it is cached, not at the step that filled it; with
  defragmentation, an eviction policy that hooks caching (FIFO, ARC) or KV
  events (a `BlockStored` belongs to the step that filled its block) each
  cache stays in its step. With op records, the filling slot's write is
  recorded late like the others (caching records no op). When the token budget binds and a
  lazy sequence comes after a prefill in RUNNING order (the prefill may take
  the budget first), every sequence is visited again (`materialize`).
- Blocked head: once the head of WAITING fails to allocate, it is not retried
  while the retry must fail (`BlockedHead`).

Both are exact: tests/sim/engine/test_engine.py compares every table with the
switch on and off. With op records, a lazy sequence's writes are recorded when
it is visited again, stamped with their steps (`KVCacheManager.record_decodes`), and the op log
merges each into its step's schedule (`kvcache.op_files.merge_keys`).
Lazy decodes stay off where `allocate_slots` does more (a sliding window with one group,
lookahead slots; `decode_shortcuts`), under priority scheduling and where a step's budget is below
max_num_seqs. vLLM's hybrid groups keep them where every window is a multiple of the block size:
a window then lets go of a block only on a block's last slot (a chunk on its first), which are
visited, and a Mamba group of its previous state on a block's second slot, visited too; their
blocks fill eagerly (not `fills`: a window may drop a block before a deferred caching). The
blocked-head skip stays off with one group's window; over vLLM's hybrid groups it uses the hybrid
manager's own count of what the head lacks and a watch on its hit (`allocation_deficit`,
`watch_hit`), with no lookahead slots. The async output takes the blocked head (a head's retry fails
or not by the manager's state, whichever output mode applies the steps) and, with no lookahead,
priority or connector, where every window (one group's, or vLLM's hybrid groups') is a
sliding one of whole blocks (`async_decode_shortcuts`), lazy decodes of its own
(`AsyncLazy`): a lazy sequence rejoins the batch in flight when it is brought up to date, and a
step at which every running sequence is lazy and none is due skips the RUNNING pass (`lazy_step`,
most steps of a lightly loaded engine; the engine takes runs of them, WAITING empty, and of steps
whose pass visits plain decodes, in a loop of its own, `sim.engine.async_quiet`); and,
where the order of caches cannot show (one group, no window, no KV events, no policy that hooks caching), a
block holding a unique decoded token is cached once its sequence is freed, as `fills` has it for
sync (`KVCacheManager.defer_unique_caching`: the async output asks for a cache a visit).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from kvsim.kvcache.block import KVCacheBlock
from kvsim.kvcache.manager import KVCacheManager
from kvsim.kvcache.sequence import Sequence

if TYPE_CHECKING:
    from kvsim.sim.engine.batch import Batch, Live


class Lazy(Protocol):
    """What lazy decoding needs of a running sequence (the scheduler's `Live`)."""

    seq: Sequence
    since: int  # the step it went lazy; -1: not lazy
    wake: int  # the first step it must be visited again


class Wakes(dict):
    """Step -> the lazy sequences whose laziness ends there, stale ones too (dropped early, and maybe
    lazy again since: skipped when that step comes). What both kinds of lazy decodes share
    (`LazyDecodes`, `AsyncLazy`); each brings a sequence up to date its own way (`drop`)."""

    def add(self, live: Lazy) -> None:
        """`live` is due at its `wake`."""
        w = self.get(live.wake)
        if w is None:
            self[live.wake] = [live]
        else:
            w.append(live)

    def due(self, k: int, drop: Callable[[Lazy, int], None]) -> list[Lazy]:
        """`drop(live, k)` and return the sequences due at step k."""
        woken = self.pop(k, None) if self else None
        if not woken:
            return []
        out = []
        for live in woken:
            if live.since >= 0 and live.wake == k:  # else dropped early (and maybe lazy again)
                drop(live, k)
                out.append(live)
        return out

    def drop_all(self, lives: list[Lazy], k: int, drop: Callable[[Lazy, int], None]) -> None:
        """`drop(live, k)` every lazy sequence among `lives`; none is due after."""
        for live in lives:
            if live.since >= 0:
                drop(live, k)
        self.clear()


class LazyDecodes:
    """The lazy sequences' count, their batch totals, and when each must be visited again."""

    def __init__(self, block_size: int):
        self.bs = block_size
        self.n = 0
        self._ctx = 0  # sum of (computed + 1 - since)
        self._frag = 0  # sum of (bs - 2 - computed % bs + since)
        self.wakes = Wakes()
        self._fills: dict[int, int] = {}  # step -> lazy sequences whose block fills at it
        self.record: Callable[[Lazy, int], None] | None = None  # (live, k): its writes of steps since..k-1
        self.fills = False  # a block of unique decoded tokens may fill lazily (cached when freed)

    def add(self, live: Lazy, k: int, last: int) -> None:
        """`live` (computed tokens c, c % bs in [0, bs - 2]) decodes in place at step k and at
        the `last` steps after it (the last may fill its block); it is visited again at step
        k + last + 1."""
        c = live.seq.num_computed_tokens
        live.since, live.wake = k, k + last + 1
        self.n += 1
        self._ctx += c + 1 - k
        self._frag += self.bs - 2 - c % self.bs + k
        if (c + last + 1) % self.bs == 0:  # a full block holds no empty slot, not -1
            self._fills[k + last] = self._fills.get(k + last, 0) + 1
        self.wakes.add(live)

    def window(self, seq: Sequence, c: int) -> int:
        """Steps `seq`, decoding position c now, may decode lazily after this one: to its block's
        last slot but one, or to its last slot where that block holds a unique decoded token."""
        bs = self.bs
        if self.fills and c // bs >= seq.num_known_tokens // bs:
            return bs - 1 - c % bs
        return bs - 2 - c % bs

    def drop(self, live: Lazy, k: int) -> None:
        """Bring `live`'s `seq` up to date at the start of step k; it is no longer lazy."""
        seq, d = live.seq, k - live.since
        if self.record is not None:
            self.record(live, k)
        c = seq.num_computed_tokens
        self.n -= 1
        self._ctx -= c + 1 - live.since
        self._frag -= self.bs - 2 - c % self.bs + live.since
        if k < live.wake and (c + live.wake - live.since) % self.bs == 0:  # dropped before its block filled
            f = live.wake - 1
            if self._fills[f] == 1:
                del self._fills[f]
            else:
                self._fills[f] -= 1
        seq.num_computed_tokens = c + d
        seq.num_tokens += d
        live.since = -1

    def due(self, k: int) -> list[Lazy]:
        """Drop and return the sequences to visit again from step k on."""
        return self.wakes.due(k, self.drop)

    def drop_all(self, lives: list[Lazy], k: int) -> None:
        """Drop every lazy sequence among `lives` at the start of step k."""
        self.wakes.drop_all(lives, k, self.drop)
        self._fills.clear()

    def context_tokens(self, k: int) -> int:
        """Sum of the lazy sequences' lengths after step k's decode (before its sample)."""
        return self._ctx + self.n * k

    def empty_slots(self, k: int) -> int:
        """Allocated slots of their last blocks not holding a token, after step k (asked once a step)."""
        return self._frag - self.n * k + (self._fills.pop(k, 0) if self._fills else 0)


class AsyncLazy:
    """Lazy decodes under the async output (vLLM's AsyncScheduler behind EngineCore's two-deep batch
    queue): the same idea as `LazyDecodes`, with the async counters.

    A running request that decodes at step k with its previous token's batch in flight (at rest
    before the step: computed = known tokens, one placeholder, one token in flight) and whose next
    positions fall inside its last block needs no block, copy or cache entry until that block fills:
    it is scheduled at k as usual, then counted, not visited, at steps k + 1 .. wake - 1, and neither
    `after_schedule` nor `update` sees it there. (Under async a block is cached when the token after
    it is scheduled, so the last slot may be lazy too.) Batches k - 1 and k still carry it, so once
    both are applied its `seq` and counters rest at c1 computed (after step k), c1 + 1 known, nothing
    in flight. `drop` brings it up to date before step K's schedule: c1 + d computed and known
    (d = K - since, the steps it was counted at), one placeholder and one token in flight, in batch
    K - 1 (the scheduler's `last_batch`, not applied yet), which it joins: that batch's output then
    samples its token as plain stepping's does. The lazy ones never finish, take a block, cache one,
    free one or decode a shared block, so nothing else depends on the order they join it in.
    """

    fills = False  # (a block is cached in its step: `LazyDecodes.fills`)

    def __init__(self, block_size: int, last_batch: Callable[[], Batch]):
        self.bs = block_size
        self.last_batch = last_batch  # the batch scheduled last: in flight while the next is chosen
        self.n = 0
        self.record: Callable[[Lazy, int], None] | None = None  # (live, k): its writes of steps since..k-1
        self._ctx = 0  # sum of (c1 + 1 - since): a lazy one's length after step k is c1 + 1 + k - since
        self._slots = 0  # sum of (blocks * bs - c1 + since - 2): its empty slots after batch j's output
        self.wakes = Wakes()
        self._c1: dict[int, tuple[int, int]] = {}  # id(live) -> (c1, its blocks)

    def add(self, live: Lazy, k: int, last: int, c1: int, blocks: int) -> None:
        """`live`, scheduled at step k (c1 computed tokens after it), is counted at the `last` steps
        after k and visited again at k + last + 1; `blocks`: its table's length."""
        since = k + 1
        live.since, live.wake = since, since + last
        self.n += 1
        self._ctx += c1 + 1 - since
        self._slots += blocks * self.bs - c1 + since - 2
        self._c1[id(live)] = (c1, blocks)
        self.wakes.add(live)

    def drop(self, live: Lazy, k: int) -> None:
        """Bring `live` up to date before step k's schedule (see the class docstring); not lazy after."""
        c1, blocks = self._c1.pop(id(live))
        since = live.since
        if self.record is not None and k > since:  # its writes at steps since..k-1, late
            self.record(live, k)
        self.n -= 1
        self._ctx -= c1 + 1 - since
        self._slots -= blocks * self.bs - c1 + since - 2
        live.since = -1
        d = k - since
        if d <= 0:  # dropped at the step after its visit: batch k - 1 still carries it, nothing lags
            return
        seq = live.seq
        seq.num_computed_tokens = c1 + d
        seq.num_tokens = c1 + d
        live.ph = live.inflight = 1
        b = self.last_batch()
        b.lives.append(live)
        b.tokens.append(1)
        b.sampled.append(True)
        b.lazy -= 1  # (counted there as lazy, now a member)

    def due(self, k: int) -> list[Lazy]:
        """Drop and return the sequences to visit again from step k on."""
        return self.wakes.due(k, self.drop)

    def drop_all(self, lives: list[Lazy], k: int) -> None:
        """Drop every lazy sequence among `lives` before step k's schedule."""
        self.wakes.drop_all(lives, k, self.drop)

    def context_tokens(self, k: int) -> int:
        """Sum of the lazy sequences' lengths after step k."""
        return self._ctx + self.n * k

    def empty_slots(self, k: int) -> int:
        """(The async output counts empty slots when a batch's output is applied: `applied_slots`.)"""
        return 0

    def applied_slots(self, j: int) -> int:
        """Allocated slots of the lazy sequences not holding a token, once batch j's output is applied
        (batch j + 1 scheduled): each knows c1 + 2 + j - since tokens then."""
        return self._slots - self.n * j


class BlockedHead:
    """The head of WAITING failed to allocate; tells cheaply, and exactly, when a retry must fail too.

    NOTE: with F free blocks, H the hit blocks and n the new slots, allocation
    fails iff deficit = cdiv(hit + n) - |H| + |H free| (+ watermark) - F > 0.
    While H keeps its blocks (none evicted, no new entry at its miss point),
    the deficit shrinks only by freed blocks (at most 1 each), a smaller budget
    or a dropped watermark; allocations elsewhere and touches never shrink it.
    Evictions matter only when the budget can cut the retry short: otherwise
    cdiv(hit + n) is the whole sequence whatever the hit, and a hit block turns
    from free to used (shrinking the deficit by 1) only as some allocation or
    touch takes a free block (growing it by 1).
    """

    __slots__ = ("m", "live", "hits", "deficit", "frees", "evictions", "n", "watermark")

    def __init__(self, m: KVCacheManager, live: Live, blocks: list[KVCacheBlock], hit: int, n: int,
                 lookahead: int, watermark: bool):
        self.m, self.live, self.hits, self.n, self.watermark = m, live, blocks, n, watermark
        self.frees, self.evictions = m.op_counts["free"], m.op_counts["evict"]
        if m.num_groups > 1:  # vLLM's hybrid groups: the manager counts and watches its hit
            self.deficit = m.allocation_deficit(live.seq, blocks, hit, n, watermark)
            m.watch_hit(live.seq, blocks)
            return
        # the admission gate asks for the whole known context (see KVCacheManager.allocate_slots)
        need = m.num_blocks_to_allocate(live.seq, max(hit + n + lookahead, live.seq.num_tokens), blocks)
        self.deficit = need + (m.watermark_blocks if watermark else 0) - m.num_free_blocks

    def margin(self) -> int:
        """Blocks the head lacks at least now: it stays blocked while fewer than these are freed
        (and its hit keeps its blocks)."""
        return self.deficit - (self.m.op_counts["free"] - self.frees)

    def still(self, live: Live, budget: int, watermark: bool) -> bool:
        """True if allocating `live` now would certainly fail as it did."""
        # NOTE: the retry would ask for min(tokens left, budget) new tokens; with the
        # same hit that is n again unless the budget fell below it
        if live is not self.live or budget < self.n or watermark < self.watermark:
            return False
        m, seq, k = self.m, live.seq, len(self.hits)
        counts = m.op_counts
        if self.margin() <= 0:
            return False
        if m.num_groups > 1:
            return m.hit_unchanged()
        if m.enable_caching and k < (seq.num_tokens - 1) // m.block_size and m.is_cached(seq.block_hashes[k]):
            return False  # the hit may have grown
        if counts["evict"] != self.evictions and budget < seq.num_tokens \
                and [b.block_hash for b in self.hits] != seq.block_hashes[:k]:
            return False  # a hit block was evicted, and a shorter hit may mean a smaller chunk
        return True


class Shortcuts:
    """One scheduler's shortcut state: the running sequences it visits (`active`), the lazy
    ones, and the blocked head. With the switch off it only keeps `active` (= RUNNING)."""

    def __init__(self, m: KVCacheManager, on: bool, lookahead: int, priority: bool, *, whole_fit: bool = True,
                 decodes_fit: bool = True, lazy: bool = True, last_batch: Callable[[], Batch] | None = None):
        self.m = m
        self.bs, self.tables = m.block_size, m.block_tables
        self.lookahead = lookahead
        # NOTE: lazy decodes assume a step's budget holds every running decode (`decodes_fit`:
        # max_num_seqs <= the step budget); a smaller max_num_scheduled_tokens turns them off
        # (`lazy` False: the async output, whose every step visits every running sequence)
        self.decodes = on and lazy and decodes_fit and m.decode_shortcuts and not (lookahead or priority)
        self.decode_slot = m.decode_slot if self.decodes else None
        self.windows = m.num_groups > 1  # (one group's window turns lazy decodes off)
        # a Mamba group lets the previous state go at a block's second slot: visited, lazy after it
        self.mamba = getattr(m, "has_mamba", False)
        # BlockedHead's arithmetic, with the whole-fit gate: one group's without a window, or the
        # hybrid manager's own (`allocation_deficit`, `watch_hit`), with no lookahead slots
        # (not with Mamba groups: a hit hashed this step fails until the next, whatever is free)
        self.heads = on and m.sliding_window is None and whole_fit and (m.num_groups == 1 or not lookahead) \
            and not getattr(m, "has_mamba", False)
        self.lazy = LazyDecodes(m.block_size)  # running lives decoding mid-block, not visited
        # the async output (`last_batch`: the scheduler's batch in flight): lazy decodes of its own
        # (`AsyncLazy`), with no lookahead or priority, where every window is a sliding one of whole
        # blocks (`async_decode_shortcuts`: it lets go at a block's first slot then, visited).
        # NOTE: with op records a step's ops come in two runs under async output (its schedule's, then
        # its output's after the next step's schedule); the op log merges a late write into the first
        # (`set_step`'s marks, `merge_keys`), where merging by step alone would reorder the runs
        self.async_decodes = on and last_batch is not None and decodes_fit and not (lookahead or priority) \
            and m.async_decode_shortcuts and m.defrag is None
        if self.async_decodes:
            self.lazy = AsyncLazy(m.block_size, last_batch)
        self._stamps = [0] * 2 * self.bs  # the manager's number of our step k, at k % (2 bs)
        self.records = (self.decodes or self.async_decodes) and m.records_ops
        if self.records:
            self.lazy.record = self._record
            m.keep_late_ops(self.bs)  # late writes: a lazy run lasts at most bs - 1 steps
        if self.decodes and m.defrag is None and not m.caching_hooks_policy and m.num_groups == 1 \
                and not m.emits_events:
            self.lazy.fills = True  # (defrag, such policies and KV events keep each cache in its step)
        if self.async_decodes and getattr(m, "can_defer_unique_caching", False):
            m.defer_unique_caching()  # (the async output's `fills`: a unique block is cached once freed)
        self.active: list[Live] = []  # the running lives not decoding lazily, in RUNNING order
        self._going: list[tuple] = []  # the async output's lives going lazy after this step (`after`)
        self.blocked: BlockedHead | None = None
        self._counted = 0  # this step's decodes whose write `decode_slot` counted

    # ---------------------------------------------------------- lazy decodes
    def stamp(self, k: int) -> None:
        """Our step k is the manager's current op step (a quiet step's, as `begin` notes it)."""
        self._stamps[k % len(self._stamps)] = self.m.op_step

    def begin(self, k: int, max_tokens: int, running: list[Live]) -> int:
        """Start step k's pass over RUNNING: wake the lazy sequences due, and end all laziness
        if the budget binds. Returns the token budget left for `active`."""
        lazies, active = self.lazy, self.active
        self.stamp(k)
        self.wake(k)
        self._counted = 0
        budget = max_tokens - lazies.n
        if lazies.n and budget < sum(x.seq.num_tokens - x.seq.num_computed_tokens for x in active) \
                and not _lazy_first(running, active):
            self.materialize(running, k)  # the budget binds: visit everyone, in order
            budget = max_tokens
        return budget

    def wake(self, k: int) -> None:
        """The lazy sequences due at step k are brought up to date and visited again (`active`, kept
        in RUNNING order)."""
        woken = self.lazy.due(k)
        if woken:
            self.active.extend(woken)
            self.active.sort(key=_order)

    def decode(self, b: Batch, live: Live, c: int, k: int) -> bool:
        """Schedule `live`'s decode token (c computed, prompt done) at step k without the general
        path, if it needs nothing but a slot; False: the caller allocates it as usual."""
        # NOTE: a decode token landing mid-block (not its first or last slot) in an unshared
        # block needs no block, copy or cache entry. One landing on a block's first or last
        # slot may take a new block or cache the filled one: `decode_slot` does either. Nothing
        # reads a running sequence before complete(), so the token is computed and sampled here.
        seq, bs = live.seq, self.bs
        r = c % bs
        if r and r < bs - 1:
            if self.tables[seq.seq_id][c // bs].ref_cnt != 1:
                return False  # shared with a fork: copy-on-write
            if self.windows:  # blocks its prefill left behind a window go back at its first decode
                self.m.remove_skipped_blocks(seq)
        else:
            got = self.decode_slot(seq)  # None: no free block; False: copy-on-write
            if got is None or got is False:
                return False
            self._counted += 1  # the manager counted its write
        last = self.lazy.window(seq, c) if r or not self.mamba else 0
        if live.target - c - 3 < last:  # visited at the step sampling its last token
            last = live.target - c - 3
        if last > 0:
            # Only a fork shares a partial block, and only at its prefill's end:
            # this one stays unshared until it fills.
            self.lazy.add(live, k, last)
            return True
        if self.records and r and r < bs - 1:  # recorded in place, not late: it may finish now
            self.decode_slot(seq)
            self._counted += 1
        seq.num_computed_tokens = c + 1
        seq.append_tokens(1)
        b.decodes.append(live)
        b.decode_tokens += 1
        b.context_tokens += c + 1
        if c + 2 >= live.target:
            b.finishing.append(live)
        elif r < bs - 1:
            b.frag += bs - r - 2  # its last block's empty slots
        return True

    def after(self, live: Live, c: int, k: int) -> None:
        """The async output (`async_decodes`): `live`, c computed before its decode token was just
        scheduled at step k, decodes lazily after k if it was at rest (one token in flight, computed
        = known) and its next positions stay in its last block, short of the request's last tokens."""
        seq = live.seq
        if live.ph != 1 or live.inflight != 1 or live.stale or c != seq.num_tokens:
            return
        r = c % self.bs
        if self.mamba and r < 2:
            # NOTE: a Mamba group lets its previous state go on the processed tokens (one behind):
            # at the decode of a block's third slot (`MambaAlign.skipped`), which is visited
            return
        last = self.bs - 1 - r
        if live.target - c - 4 < last:
            last = live.target - c - 4
        if last > 0:  # (counted from step k + 1 on: `end` adds it once step k's totals are taken)
            self._going.append((live, k, last, c + 1, len(self.tables[seq.seq_id])))

    def end(self, b: Batch, k: int) -> None:
        """End step k's pass over RUNNING: count the lazy decodes into the batch and the manager (under
        the async output, then those that go lazy after it join them)."""
        lazies = self.lazy
        nl = b.lazy = lazies.n
        # NOTE: one write per decode applied here or lazy now, less those decode_slot counted
        # (a lazy one preempted since gave its token back: its write is taken back too)
        writes = len(b.decodes) + nl - self._counted
        if writes:
            self.m.count_writes(writes)
        if nl:
            b.decode_tokens += nl
            b.context_tokens += lazies.context_tokens(k)
            b.frag += lazies.empty_slots(k)
        if self._going:
            for live, *args in self._going:
                if live.order >= 0:
                    lazies.add(live, *args)
            self._going.clear()
        self.active = [x for x in self.active if x.order >= 0 and x.since < 0]

    def lazy_only(self, k: int, max_tokens: int) -> bool:
        """Whether step k's RUNNING pass visits no one under the async output's lazy decodes: every
        running sequence is lazy, none is due at k, and a budget of `max_tokens` holds their tokens."""
        lazies = self.lazy
        return self.async_decodes and 0 < lazies.n <= max_tokens and not self.active and k not in lazies.wakes

    def lazy_step(self, b: Batch, k: int, max_tokens: int) -> int:
        """The RUNNING pass of step k where `lazy_only` holds (`Scheduler.schedule` asks): `begin`
        would wake no one and the pass visit no one, so `end`'s lazy totals are all it does, counted
        into `b` and the manager (inline: most steps of a lightly loaded engine come here, and `end`'s
        pass over those that go lazy and over `active` has no one to see). Returns the budget left,
        as `begin` does."""
        self.stamp(k)
        self._counted = 0
        lazies = self.lazy
        nl = b.lazy = lazies.n
        self.m.count_writes(nl)
        b.decode_tokens += nl
        b.context_tokens += lazies.context_tokens(k)
        b.frag += lazies.empty_slots(k)
        return max_tokens - nl

    def _record(self, live: Lazy, k: int) -> None:
        """Record the writes `live` made lazily, at steps since..k-1 (the op log puts them in place)."""
        # NOTE: nothing else touches its block meanwhile: it is unshared and neither full nor freed
        # (nor cached, evicted, copied or swapped) until it is visited again, and the loop drops
        # every lazy sequence before defrag moves blocks (`Engine._steps`). One that went lazy on
        # its block's first slot had that step's write recorded by `decode_slot`.
        c, first = live.seq.num_computed_tokens, live.since
        if not c % self.bs:
            c, first = c + 1, first + 1
        n = k - first
        if n <= 0:
            return
        stamps, r = self._stamps, len(self._stamps)
        step = stamps[first % r]
        if stamps[(k - 1) % r] - step == n - 1:  # one manager step a step (the engine loop)
            self.m.record_decodes(live.seq, c, step, n)
        else:
            for i in range(n):
                self.m.record_decodes(live.seq, c + i, stamps[(first + i) % r], 1)

    def preempted(self, live: Live, k: int) -> None:
        """`live` leaves RUNNING at step k: it is no longer lazy, and its blocks that filled
        lazily are cached before they are freed or swapped out."""
        if live.since >= 0:
            self.lazy.drop(live, k)
        if self.lazy.fills:
            self.m.cache_blocks(live.seq, live.seq.num_computed_tokens)

    def free(self, seq: Sequence) -> None:
        """`KVCacheManager.free` for a sequence leaving RUNNING for good, its blocks that filled
        lazily cached first (a no-op for any other block: each is cached when it fills)."""
        if self.lazy.fills:
            self.m.cache_blocks(seq, seq.num_computed_tokens)
        self.m.free(seq)

    def materialize(self, running: list[Live], k: int) -> None:
        """End all lazy decoding: every running sequence's `seq` is exact at the start of step k."""
        if not self.lazy.n:
            return
        self.lazy.drop_all(running, k)
        self.active = list(running)

    # ---------------------------------------------------------- blocked head
    def head_blocked(self, live: Live, budget: int) -> bool:
        """True if admitting `live`, the head of WAITING, under `budget` must fail as it last did."""
        return self.blocked is not None and self.blocked.still(live, budget, True)

    def block_head(self, live: Live, blocks: list[KVCacheBlock], hit: int, n: int) -> None:
        """`live` (hit cached tokens, n new) just failed to allocate while others run."""
        if self.heads:
            self.blocked = BlockedHead(self.m, live, blocks, hit, n, self.lookahead, True)


def _order(live: Live) -> int:
    return live.order


def _lazy_first(running: list[Live], active: list[Live]) -> bool:
    """True if every lazy sequence comes before the first active one that wants more than one
    token, in RUNNING order: vLLM's `_schedule_running` hands the budget out in that order,
    one token to each decode (there are at most max_num_seqs <= the step budget), so
    the lazy ones keep their decode however the budget falls after them."""
    first = min((x.order for x in active if x.seq.num_tokens - x.seq.num_computed_tokens > 1), default=None)
    if first is None:
        return False
    for x in reversed(running):
        if x.order < first:
            return True
        if x.since >= 0:
            return False
    return True
