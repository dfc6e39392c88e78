"""The hybrid block manager: several KV-cache groups, each with its own block table per request,
all drawing on one block pool, as vLLM 0.33's `KVCacheManager` over its `HybridKVCacheCoordinator`
(vllm/v1/core/kv_cache_manager.py, kv_cache_coordinator.py).

A model that mixes sliding-window (or chunked local) layers with full-attention ones keeps one
group per bucket of like layers (`sim.engine.layers.hybrid_layout`); a block of the pool holds one
page of every layer of a group. Each group follows its kind's rules (`kvcache.groups`); what the
groups share is decided here:

- the cache hit: the longest prefix every group can resume from. Full attention is looked up
  first; every other kind can only lower the length; the lookups repeat until no group lowers it
  (once for one full-attention spec and one other), and the full-attention blocks are trimmed to
  the agreed length (`HybridKVCacheCoordinator.find_longest_cache_hit`). A group that cached a
  longer prefix than the agreed hit marks a shared-prefix junction, whose tail a sliding window
  then hashes under sparse retention (`KVCacheManager.get_computed_blocks`'s
  `shared_prefix_boundary`);
- an allocation fits when the sum over groups of the blocks each takes is free; the blocks a
  window no longer reads go back first, even if the allocation then fails;
- a request's blocks are freed group by group, each group's tail first
  (`KVCacheCoordinator.free`), which decides what LRU evicts first; blocks taken out for a
  deferred free come back as one list, freed from its end (`pop_blocks_for_free`).

Cache keys are per group (`groups.group_salt`), so a block hashed in one group never hits in
another. Eviction policies rank blocks of all groups together; none knows that two blocks are
siblings (the same tokens in two groups), so evicting one group's block leaves its sibling cached,
and a hit then stops where the evicted group stops (as in vLLM, whose LRU is as blind to groups).

A Mamba group (state-space or gated-delta-net state, vLLM's "align" cache mode) takes and lets go
of its blocks as `kvcache.mamba` says: one running state block a request (two while a chunk
exports a checkpoint), earlier states let go as the request advances, and a hit hashed in the
current scheduling step refused until the next (`new_step_starts`).

With `record_ops`, every op carries its group (`kvcache.ops`): table entries (the null block where
a window or Mamba group let a block go), writes (a Mamba group's: its state block's), frees and
evictions. Loads: `kvcache.hybrid_loads`. Refused by the engine: forking, swapping, KV offloading,
defragmentation; Mamba without prefix caching (vLLM's other cache mode); v2's `can_allocate`.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from types import MappingProxyType

from kvsim.kvcache.block import KVCacheBlock
from kvsim.kvcache.block_pool import BlockPool, check_memory
from kvsim.kvcache.events import KVEventLog, TokenSpan
from kvsim.kvcache.eviction import EvictionPolicy, make_policy
from kvsim.kvcache.groups import (
    GroupSpec,
    blocks_to_allocate,
    cached_ranges,
    find_longest_cache_hit,
    group_lookup,
    group_salt,
    leading_nulls,
    skipped_span,
    take_span,
)
from kvsim.kvcache.hit_watch import HitWatch
from kvsim.kvcache.hybrid_loads import HybridLoads
from kvsim.kvcache.id_span import IdSpan
from kvsim.kvcache.mamba import MambaAlign
from kvsim.kvcache.ops import OpLog
from kvsim.kvcache.pool_view import PoolView
from kvsim.kvcache.profiles import DEFAULT_VERSION, profile
from kvsim.kvcache.sequence import Sequence

Hit = tuple[list[KVCacheBlock], ...]  # one list of hit blocks a group


class HybridKVCacheManager(PoolView, HybridLoads):
    """Paged KV-cache block manager for several KV-cache groups over one pool (vLLM's hybrid manager).

    num_gpu_blocks: the shared pool's blocks as vLLM reports them (block 0, the null block, among
    them): vLLM's `--num-gpu-blocks-override`. groups: each group's spec, in vLLM's group order
    (all of one block size). in_flight_tokens / max_model_len: what the windowed groups' admission
    cap counts (`GroupSpec.admission_cap`). mamba_checkpoint_alignment: the Mamba layers' prefill
    checkpoint alignment (None: they export no checkpoint; `kvcache.mamba`). record_ops: record
    every op with its group (else only counted). kv_events: queue vLLM's KV events, each group's with
    its `group_idx` (`kvcache.events`). The other arguments are `KVCacheManager`'s.
    """

    sliding_window = None  # no single window: the engine asks `num_groups` (several groups: windowed)
    defrag = None
    admission_tokens = None

    def __init__(
        self,
        num_gpu_blocks: int,
        groups: Seq[GroupSpec],
        *,
        enable_caching: bool = True,
        eviction: str | EvictionPolicy = "lru",
        watermark: float = 0.0,
        prefix_cache_retention_interval: int | None = 0,
        in_flight_tokens: int = 0,
        max_model_len: int | None = None,
        mamba_checkpoint_alignment: int | None = None,
        record_ops: bool = False,
        track_ids: bool = True,
        vllm_version: str = DEFAULT_VERSION,
        kv_events: bool = False,
    ):
        if not groups:
            raise ValueError("a hybrid cache needs at least one group")
        sizes = {g.block_size for g in groups}
        if len(sizes) > 1:
            raise ValueError(f"groups of block sizes {sorted(sizes)}: groups of different block sizes (vLLM's "
                             "hybrid block-size alignment for state-space layers) are not modelled")
        check_memory(num_gpu_blocks)
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.profile = profile(vllm_version)
        self.profile.check_watermark(watermark)
        self.groups = tuple(groups)
        self.block_size = bs = groups[0].block_size
        self.enable_caching = enable_caching
        retention = prefix_cache_retention_interval if self.profile.sparse_retention else None
        sparse = any(g.sparse for g in groups)
        if retention is not None and (retention < 0 or retention % bs):
            raise ValueError(f"prefix_cache_retention_interval ({retention}) must be non-negative and a multiple "
                             f"of the block size ({bs})")
        if retention and not sparse:  # vllm/v1/core/kv_cache_coordinator.py _validate_prefix_cache_retention_interval
            raise ValueError("prefix_cache_retention_interval is set but this cache has no sliding-window or Mamba "
                             "group, so retention has no effect; set it to 0 (vLLM refuses it too)")
        self.retention_interval = retention
        self.ops = OpLog(record_ops)
        self.op_counts = MappingProxyType(self.ops.counts)
        policy = make_policy(eviction, bs) if isinstance(eviction, str) else eviction
        self.pool = BlockPool(num_gpu_blocks, enable_caching=enable_caching, policy=policy, ops=self.ops,
                              free_first=self.profile.free_first(enable_caching))
        if track_ids:
            self.pool.tracker = IdSpan(self.pool.blocks)
        self.null_block = self.pool.null_block
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.caps = tuple(g.admission_cap(in_flight_tokens, max_model_len) for g in groups)
        self.salts = tuple(group_salt(i) for i in range(len(groups)))
        self.events = self.pool.events = KVEventLog(self.salts) if kv_events else None
        self.tables: tuple[dict[str, list[KVCacheBlock]], ...] = tuple({} for _ in groups)
        self.num_cached: tuple[dict[str, int], ...] = tuple({} for _ in groups)
        self.junctions: dict[str, int] = {}  # seq id -> its shared-prefix boundary, found at lookup
        # per group, for the run's metrics: its blocks in use now and at most (a shared hit counts once),
        # blocks a window let go of, and the hit tokens each group alone offered the requests hitting
        n = len(groups)
        self.held, self.peak, self.freed_behind, self.own_hits = [0] * n, [0] * n, [0] * n, [0] * n
        # each block's group where a deferred free (set as it is popped), a recorded op or a KV event names it
        # (an eviction is counted for `KVCacheBlock.group`, which the pool sets as it caches the block)
        self.pool.group_of = self.ops.group_of = self._group_of = [0] * num_gpu_blocks
        self.pool.evicted_by_group = [0] * n
        self._own: dict[str, list[int]] = {}  # seq id -> its last lookup's per-group hit tokens
        self.hit_watch = HitWatch()  # a blocked head's lookup (`watch_hit`)
        self.block_tables = MappingProxyType(self.tables[0])  # the first group's tables (every live sequence)
        # vLLM's SpecGroups: equal specs looked up together, full attention first (its sort is stable)
        merged: dict[GroupSpec, list[int]] = {}
        for i, g in enumerate(groups):
            merged.setdefault(g, []).append(i)
        self.spec_groups = sorted(merged.items(), key=lambda item: item[0].kind != "full")
        # each group's spec as an int (equal specs, one int): `_cache` keys its memo by it, not by
        # hashing the spec's fields for every group each call
        self._spec_id = [0] * len(groups)
        for i, (_, ids) in enumerate(self.spec_groups):
            for g in ids:
                self._spec_id[g] = i
        self._simple = len(self.spec_groups) == 2 and self.spec_groups[0][0].kind == "full"
        self.empty_hit: Hit = tuple([] for _ in groups)
        if any(g.kind == "mamba" for g in groups) and not enable_caching:
            raise ValueError("Mamba groups without prefix caching (vLLM's 'none' cache mode, one state block a "
                             "request) are not modelled; kvsim models vLLM's 'align' mode, on with prefix caching")
        self._mamba = {g: MambaAlign(self.pool, bs, mamba_checkpoint_alignment)
                       for g, spec in enumerate(groups) if spec.kind == "mamba"}
        self.has_mamba = bool(self._mamba)
        # what the scheduler cuts chunks by (`kvcache.mamba.aligned_chunk`), None without Mamba groups
        self.mamba_split = (bs, mamba_checkpoint_alignment) if self._mamba else None
        # the groups that let blocks go as a request advances, in group order (vLLM's coordinator calls
        # them so): a window or chunk (its kind, window) or a Mamba group (its bookkeeping)
        # (and its spec's index: groups of one spec hold their null blocks alike, `skipped_span`)
        self._skipping = tuple((g, self._spec_id[g], spec.kind == "sliding_window", spec.window, self._mamba.get(g))
                               for g, spec in enumerate(groups) if spec.kind != "full")

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def decode_shortcuts(self) -> bool:
        """Whether a decode token landing mid-block leaves everything as it is: windows that are multiples
        of the block size let a block go only at a block's last slot (a chunk at its first)."""
        return all(w % self.block_size == 0 for _, _, _, w, ma in self._skipping if ma is None)

    @property
    def async_decode_shortcuts(self) -> bool:
        """`decode_shortcuts` with the last token in flight (async), a let-go one token behind: a window's at a
        block's first slot (visited), a chunk's at its second: so windows, and Mamba (`Shortcuts.after`)."""
        return all(s and w % self.block_size == 0 for _, _, s, w, ma in self._skipping if ma is None)

    def new_step_starts(self) -> None:
        """A scheduling step begins: hits hashed in the last one may be taken again
        (`KVCacheManager.new_step_starts`, which vLLM's `Scheduler.schedule` calls first)."""
        for ma in self._mamba.values():
            ma.cached_this_step.clear()

    # ------------------------------------------------------------------ lookup
    def get_computed_blocks(self, seq: Sequence) -> tuple[Hit, int]:
        """The longest prefix of `seq` every group holds cached (each group's hit blocks) and its
        tokens; at most `num_tokens - 1`. Nothing is allocated or touched. Records the sequence's
        shared-prefix junction for its caching."""
        self.junctions[seq.seq_id] = 0
        if not self.enable_caching:
            return self.empty_hit, 0
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        if max_blocks <= 0:
            return self.empty_hit, 0
        keys = seq.hashes_upto(max_blocks * bs, bs)
        get, null, salts = self.pool.get_cached_block, self.null_block, self.salts
        n = len(self.groups)
        hit_length = max_blocks * bs
        longest = 0
        blocks: list[list[KVCacheBlock] | None] = [None] * n
        lengths = [0] * n
        while True:
            current = hit_length
            for spec, ids in self.spec_groups:
                first = ids[0]
                if spec.kind == "full" and blocks[first] is not None:  # downward-closed: trim, don't look again
                    current = min(current, lengths[first])
                    continue
                found, current = find_longest_cache_hit(spec, current, group_lookup(get, keys, [salts[g] for g in ids]),
                                                        len(ids), null)
                for g, table in zip(ids, found, strict=True):
                    blocks[g], lengths[g] = table, current
                longest = max(longest, current)
            if current >= hit_length:
                break
            hit_length = current
            if self._simple:
                break
        keep = -(-hit_length // bs)
        for spec, ids in self.spec_groups:
            if spec.kind == "full":
                for g in ids:
                    if blocks[g] is not None:
                        del blocks[g][keep:]
        if longest > hit_length:
            self.junctions[seq.seq_id] = longest
        self._own[seq.seq_id] = lengths  # what each group alone would have given (its metrics)
        return tuple(b if b is not None else [] for b in blocks), hit_length

    # -------------------------------------------------------------- allocation
    def num_blocks_to_allocate(self, seq: Sequence, num_tokens: int, hits: Hit = (), *, num_computed: int | None = None,
                               capped: bool = False) -> int:
        """Free blocks an allocation up to `num_tokens` slots would take, summed over the groups
        (`KVCacheCoordinator.get_num_blocks_to_allocate`); `capped`: the whole-sequence gate's
        count, each windowed group at most its admission cap."""
        sid = seq.seq_id
        hits = hits or self.empty_hit
        computed = seq.num_computed_tokens if num_computed is None else num_computed
        total = 0
        mamba = self._mamba
        for g, spec in enumerate(self.groups):
            held = self.tables[g].get(sid, ())
            if g in mamba:  # (vLLM's coordinator passes prefill_end only under retention 0)
                prefill_end = max(seq.num_prompt_tokens, seq.num_tokens - 1) if self.retention_interval == 0 else 0
                total += mamba[g].blocks_to_allocate(sid, held, num_tokens, hits[g], computed, prefill_end, capped)
                continue
            total += blocks_to_allocate(spec, held, sid in self.num_cached[g], num_tokens, hits[g], computed,
                                        self.caps[g] if capped else None,
                                        self._free_hits if spec.kind == "full" else self._free_hits_nulls)
        return total

    def _free_hits(self, hits: Seq[KVCacheBlock]) -> int:  # (full attention's hits hold no null block)
        return self.pool.num_free_hits(list(hits))

    def _free_hits_nulls(self, hits: Seq[KVCacheBlock]) -> int:
        return self.pool.num_free_hits(list(hits), True)

    def allocate_slots(
        self,
        seq: Sequence,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Hit | None = None,
        num_lookahead_tokens: int = 0,
        *,
        watermark: bool = False,
        full_sequence_must_fit: bool = False,
        in_flight: int = 0,
    ) -> list[KVCacheBlock] | None:
        """`KVCacheManager.allocate_slots` over every group (vllm/v1/core/kv_cache_manager.py
        `allocate_slots`): the whole-sequence gate (capped per windowed group), then each group's
        skipped blocks back to the pool, then the sum over groups against the free blocks; the
        hits are taken by every group before any group takes new blocks, and new blocks are taken
        group by group. Returns the new blocks of all groups, or None (only skipped blocks freed).
        `in_flight`: the request's scheduled tokens whose output is not applied yet (vLLM's
        `num_in_flight_tokens`, only ever nonzero under async scheduling): the windows let go of
        blocks on the processed-token basis, `computed - in_flight`, as vLLM 0.33 does."""
        if num_new_tokens == 1 and not new_computed_blocks and not num_lookahead_tokens and not full_sequence_must_fit:
            decoded = self.decode_slot(seq, watermark, in_flight)
            if decoded is not False:
                return decoded
        if num_new_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError(f"{seq.seq_id}: negative token count")
        sid = seq.seq_id
        hits = new_computed_blocks if new_computed_blocks is not None and any(new_computed_blocks) else None
        computed = seq.num_computed_tokens + num_new_computed_tokens
        reserve = self.watermark_blocks if watermark else 0
        free = self.pool.num_free_blocks
        if full_sequence_must_fit:
            need = self.num_blocks_to_allocate(seq, seq.num_tokens, hits or self.empty_hit, num_computed=computed,
                                               capped=True)
            if need + reserve > free:
                return None
        num_slots = computed + num_new_tokens + num_lookahead_tokens
        pool = self.pool
        self.remove_skipped_blocks(seq, computed, in_flight)
        need = self.num_blocks_to_allocate(seq, num_slots, hits or self.empty_hit, num_computed=computed)
        if need + reserve > pool.num_free_blocks:
            return None
        recording = self.ops.enabled
        starts = [len(t.get(sid, ())) for t in self.tables] if recording else None
        if hits is not None:
            self._add_hits(sid, hits, computed)
        new: list[KVCacheBlock] = []
        bs = self.block_size
        mamba, go = self._mamba, self._group_of
        for g in range(len(self.groups)):
            table = self.tables[g].setdefault(sid, [])
            if g in mamba:
                got = mamba[g].allocate(sid, table, num_slots)
            else:
                n = -(-num_slots // bs) - len(table)
                if n <= 0:
                    continue
                got = pool.get_new_blocks(n)
                table.extend(got)
            new.extend(got)
            self._hold(g, len(got))
            if recording:
                for b in got:
                    go[b.block_id] = g
        if recording:
            self._record_allocation(sid, starts, computed, computed + num_new_tokens)
        if num_new_tokens:  # the blocks written, counted as one group's (KVCacheManager._emit_writes)
            self.ops.counts["write"] += (computed + num_new_tokens - 1) // bs - computed // bs + 1
        if self.enable_caching:
            self._cache(seq, min(computed + num_new_tokens, seq.num_tokens))
        return new

    def _record_allocation(self, sid: str, starts: list[int], start: int, end: int) -> None:
        """Record an allocation's ops group by group: each table's entries from `starts[g]` on (hits,
        their null blocks, new blocks), then the writes of positions [start, end): an attention
        group's slots, a Mamba group's state block (the state after `end` tokens, as a write of
        position end - 1) and before it the prefill checkpoint it exports. Writes stay counted as
        one group's (the caller counts them), as when nothing is recorded."""
        ops, bs = self.ops, self.block_size
        counted = ops.counts["write"]
        for g, table in enumerate(t[sid] for t in self.tables):
            ops.emit_table(sid, table, starts[g], group=g)
            if end <= start:
                continue
            ma = self._mamba.get(g)
            if ma is None:
                ops.emit_span(sid, [table[i].block_id for i in range(start // bs, (end - 1) // bs + 1)], start, end,
                              bs, g)
                continue
            checkpoint = ma.checkpoints.get(sid)
            if checkpoint is not None and table[checkpoint[1]] is not self.null_block:
                position, idx = checkpoint
                ops.emit_span(sid, [table[idx].block_id], position - 1, position, bs, g)
            ops.emit_span(sid, [table[(end - 1) // bs].block_id], end - 1, end, bs, g)
        ops.counts["write"] = counted

    def decode_slot(self, seq: Sequence, watermark: bool = False, in_flight: int = 0) -> list[KVCacheBlock] | None | bool:
        """`allocate_slots(seq, 1)` for a running sequence's next token, the same effects in fewer
        steps: every group's table has one length (null blocks hold a window's place), so the token
        takes a block in every group or in none; the windows' skipped blocks go back first, as in
        the general path; a Mamba group's new block is its running state (`MambaAlign.decoded`).
        False: the general path must decide (a sequence with no blocks yet). `in_flight`: as
        `allocate_slots` takes it."""
        got = self._decode(seq, watermark, in_flight)
        if got is not None and got is not False:
            self.ops.counts["write"] += 1
        return got

    def _decode(self, seq: Sequence, watermark: bool, in_flight: int = 0) -> list[KVCacheBlock] | None | bool:
        """`decode_slot` without counting its write (`decode_slot` counts it; quiet runs count them in bulk)."""
        sid, bs = seq.seq_id, self.block_size
        tables = self.tables
        first = tables[0].get(sid)
        c = seq.num_computed_tokens
        if first is None or c // bs > len(first):
            return False
        pool = self.pool
        self.remove_skipped_blocks(seq, in_flight=in_flight)
        new: list[KVCacheBlock] = []
        if c // bs == len(first):  # the token starts a block in every group, taken in group order
            n = len(tables)
            if pool.num_free_blocks < n + (self.watermark_blocks if watermark else 0):
                return None
            new = pool.get_new_blocks(n)  # (the policy's victims in order: as n takes of one)
            for g, (t, block) in enumerate(zip(tables, new, strict=True)):
                t[sid].append(block)
                self._hold(g, 1)
            if self.ops.enabled:  # (a recorded free or evict names its block's group)
                for g, block in enumerate(new):
                    self._group_of[block.block_id] = g
        elif watermark and pool.num_free_blocks < self.watermark_blocks:  # (a landed load's recomputed
            return None  # token: vLLM keeps a waiting request's watermark free even with no block to take)
        for ma in self._mamba.values():
            ma.decoded(sid, len(first), bool(new))
        if self.ops.enabled:  # every group writes its block of position c (a Mamba group: its state)
            ops, i = self.ops, c // bs
            counted = ops.counts["write"]
            for g, t in enumerate(tables):
                block = t[sid][i].block_id
                if new:
                    ops.emit_entry(sid, block, i, g)
                ops.emit_write(sid, block, c, bs, g)
            ops.counts["write"] = counted
        if self.enable_caching and (c + 1) % bs == 0 and c < seq.num_tokens:
            self._cache(seq, c + 1)
        return new

    def decode_in_place(self, seqs: list[Sequence], num_new: int = 0) -> None:
        """`decode_slot` for each of `seqs` in order (running, prompt done, one token to compute,
        their blocks unshared, the free blocks enough), no write counted: the caller counts them in
        bulk (`sim.engine.quiet`). `num_new` is ignored: a window's blocks let go between two takes
        are taken first, so the new blocks are taken one sequence at a time."""
        for seq in seqs:
            got = self._decode(seq, False)
            if got is None or got is False:
                raise AssertionError(f"{seq.seq_id}: decode_in_place with no block for its token")

    def remove_skipped_blocks(self, seq: Sequence, computed: int | None = None, in_flight: int = 0) -> None:
        """Return the blocks `seq`'s windows and Mamba states no longer need at `computed` tokens
        (default: its computed tokens, a decode's: a 1-token chunk exports no checkpoint) less
        `in_flight` (async output: on the processed tokens, as `allocate_slots` takes it) to the pool,
        each group's last first (vLLM's `remove_skipped_blocks`, which `allocate_slots` runs first).
        A window whose last skipped block is null already has none to give."""
        sid = seq.seq_id
        c = seq.num_computed_tokens if computed is None else computed
        if in_flight:  # (async output) on the processed tokens
            c = max(0, c - in_flight)
        null, tables, recording, removed = self.null_block, self.tables, self.ops.enabled, []
        spans = self._skipped_spans(sid, c)
        for g, _, _, _, ma in self._skipping:
            if ma is not None:  # a Mamba group
                if computed is None:  # a decode's (the shortcuts'): a 1-token chunk exports no checkpoint
                    ma.checkpoints.pop(sid, None)
                table = tables[g].get(sid)
                for blocks, entries in ma.skipped(sid, table, c) if table else ():
                    removed.append((g, blocks))
                    for i in entries if recording else ():
                        self.ops.emit_entry(sid, null.block_id, i, g)
                continue
            if g in spans:
                (lo, end), table = spans[g], tables[g][sid]
                removed.append((g, take_span(table, lo, end, null)))
                if recording:  # (the entries it nulled)
                    self.ops.emit_table(sid, table, lo, end, group=g)
        if removed:
            self._release(removed)

    def _skipped_spans(self, sid: str, c: int) -> dict[int, tuple[int, int]]:
        """Each window or chunk group with blocks to let go at `c` computed tokens: the [lo, end) of
        its table they fill (`groups.skipped_span`, found once a spec: its groups hold nulls alike)."""
        bs, null, out, spans = self.block_size, self.null_block, {}, {}
        for g, k, sliding, window, ma in self._skipping:
            span = spans.get(k) if ma is None else (0, 0)
            if span is None:
                skipped = c - window + 1 if sliding else c // window * window  # GroupSpec.skipped_tokens
                table = self.tables[g].get(sid) if skipped >= bs else None
                span = spans[k] = skipped_span(table, skipped // bs, null) if table else (0, 0)
            if span[0] < span[1]:
                out[g] = span
        return out

    def _release(self, removed: list[tuple[int, list[KVCacheBlock]]]) -> None:
        """Blocks the groups' windows no longer read back to the pool, group by group (as vLLM's
        coordinator calls each manager's `remove_skipped_blocks`), counted for their metrics."""
        freed = self.pool.free_runs([blocks for _, blocks in removed])
        held, behind = self.held, self.freed_behind
        for (g, blocks), n in zip(removed, freed, strict=True):
            held[g] -= n
            behind[g] += len(blocks)

    def _hold(self, g: int, n: int) -> None:
        """Group g's blocks in use grew by `n` (new blocks, or hits taken out of the free set)."""
        held = self.held[g] = self.held[g] + n
        if held > self.peak[g]:
            self.peak[g] = held

    def _free_group(self, g: int, ordered: list[KVCacheBlock]) -> None:
        """`free_blocks(ordered)` of group g's blocks; those it returned to the free set leave the
        group's count (a block shared by requests is in use until its last one lets it go)."""
        pool, before = self.pool, self.pool.num_free_blocks
        pool.free_blocks(ordered)
        self.held[g] -= pool.num_free_blocks - before

    def _add_hits(self, sid: str, hits: Hit, computed: int) -> None:
        """A new request's hits join its tables: every group's touched first, with null blocks for
        the ones its window skips (`SingleTypeKVCacheManager.add_local_computed_blocks`)."""
        if any(sid in counts for counts in self.num_cached):  # a running request has no new hits
            return
        own = self._own.pop(sid, None)
        for g, spec in enumerate(self.groups):
            skipped = spec.skipped_tokens(computed) // self.block_size
            taken = hits[g][skipped:]
            if self.enable_caching:  # (those it takes out of the free set are in use now)
                before = self.pool.num_free_blocks
                self.pool.touch(taken)
                self._hold(g, before - self.pool.num_free_blocks)
            table = self.tables[g].setdefault(sid, [])
            table.extend([self.null_block] * skipped)
            table.extend(taken)
            self.num_cached[g][sid] = len(table)
            self.own_hits[g] += own[g] if own is not None else 0

    def cache_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Cache `seq`'s full blocks within its first `num_tokens` tokens, in every group."""
        if not self.enable_caching:
            return
        if not self._mamba:  # no group with a block to cache: `_cache` would do nothing (async asks each step)
            n_full, sid = num_tokens // self.block_size, seq.seq_id
            for counts in self.num_cached:
                if n_full > counts.get(sid, 0):
                    break
            else:
                return
        self._cache(seq, num_tokens)

    def _cache(self, seq: Sequence, num_tokens: int) -> None:
        """Each group hashes its newly full blocks (`KVCacheCoordinator.cache_blocks`): all of them,
        or for a sliding window under sparse retention the tails before the replay boundary and the
        junction (`groups.cached_ranges`)."""
        sid, bs = seq.seq_id, self.block_size
        n_full = num_tokens // bs
        keys = None
        boundaries = (seq.num_prompt_tokens - 1,)
        junction = self.junctions.get(sid, 0)
        if junction:
            boundaries += (junction,)
        chain = seq.num_prompt_tokens // bs
        ranges: dict[tuple[int, int], list[tuple[int, int]]] = {}  # groups of one spec share them
        spec_id = self._spec_id
        for g, spec in enumerate(self.groups):
            counts = self.num_cached[g]
            n_cached = counts.get(sid, 0)
            if n_full <= n_cached:
                continue
            if keys is None:
                keys = seq.hashes_upto(n_full * bs, bs)
            table = self.tables[g][sid]
            memo = (spec_id[g], n_cached)
            kept = ranges.get(memo)
            if kept is None:
                kept = ranges[memo] = cached_ranges(spec, n_cached, n_full, boundaries, self.retention_interval)
            if self.events is not None:
                self.events.stored(table, keys, kept, n_cached, n_full, TokenSpan(seq, n_cached * bs, n_full * bs),
                                   bs, self.null_block, g)
            for a, b in kept:
                # (only a cached block can be evicted: the pool sets its group here)
                self.pool.cache_blocks(table, keys, a, b, chain, self.salts[g], g)
                self.hit_watch.caching(keys, a, b)
                if g in self._mamba:  # hashed this step: not a hit before the next
                    self._mamba[g].cached_this_step.update(table[i].block_hash for i in range(a, b)
                                                           if table[i] is not self.null_block)
            counts[sid] = n_full
        for g, ma in self._mamba.items():
            table = self.tables[g].get(sid)
            if table is not None:
                ma.checkpoint_key_kept(sid, table, seq.num_prompt_tokens, junction, self.retention_interval)

    # ------------------------------------------------------------------- free
    def free(self, seq: Sequence) -> None:
        """Release a finished or recompute-preempted sequence's blocks group by group, each group's
        tail first (`KVCacheCoordinator.free`)."""
        for g, blocks in enumerate(self._pop(seq)):
            self._free_group(g, blocks[::-1])

    def pop_blocks_for_free(self, seq: Sequence) -> list[KVCacheBlock]:
        """Take a sequence's blocks out of its tables without returning them (vLLM 0.33
        `KVCacheCoordinator.pop_blocks_for_free`: the groups' blocks in group order, each without
        its leading null blocks); `free_popped` returns them, from the end."""
        out: list[KVCacheBlock] = []
        go = self._group_of
        for g, blocks in enumerate(self._pop(seq)):
            for b in blocks:  # (`free_popped` counts each block's group out)
                go[b.block_id] = g
            out.extend(blocks)
        return out

    def free_popped(self, blocks: list[KVCacheBlock]) -> None:
        """Return blocks `pop_blocks_for_free` took out, from the end (one free, as vLLM's); a block
        whose last reference this was leaves its group's count."""
        go, held, null = self._group_of, self.held, self.null_block
        for b in blocks:
            if b.ref_cnt == 1 and b is not null:
                held[go[b.block_id]] -= 1
        self.pool.free_blocks(blocks[::-1])

    def _pop(self, seq: Sequence) -> list[list[KVCacheBlock]]:
        sid = seq.seq_id
        if sid not in self.tables[0]:
            raise KeyError(f"free of unknown sequence {sid!r}")
        if self.ops.enabled:
            self.ops.keep_sequence(seq)
        self.junctions.pop(sid, None)
        out = []
        null = self.null_block
        self._own.pop(sid, None)
        for g in range(len(self.groups)):
            blocks = self.tables[g].pop(sid, [])
            self.num_cached[g].pop(sid, None)
            if g in self._mamba:  # null blocks between its states too
                self._mamba[g].forget(sid)
                lo = next((i for i, b in enumerate(blocks) if b is not null), len(blocks))
                out.append(blocks[lo:])
                continue
            out.append(blocks[leading_nulls(blocks, len(blocks), null):])
        return out

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix if no sequence holds blocks (else False, nothing changes)."""
        if self.tables[0]:
            return False
        return self.pool.reset_prefix_cache()

    # ---------------------------------------------------------- engine views
    def holds_blocks(self, seq_id: str) -> bool:
        return seq_id in self.tables[0]

    def num_cached_blocks_of(self, seq_id: str) -> int:
        return self.num_cached[0].get(seq_id, 0)

    def record_decodes(self, seq: Sequence, pos: int, step: int, n: int) -> None:
        """Record (not count) `n` one-token writes of `seq` from position `pos` on, the i-th at step
        `step + i`, in every group's block of `pos` (a Mamba group's: its running state), late
        (`KVCacheManager.record_decodes`)."""
        sid, bs = seq.seq_id, self.block_size
        for g, t in enumerate(self.tables):
            self.ops.late_writes(sid, t[sid][pos // bs].block_id, step, n, pos % bs, pos, g)

    def block_ids(self, seq_id: str, group: int = 0) -> list[int]:
        return [b.block_id for b in self.tables[group].get(seq_id, ())]

    def group_block_counts(self) -> list[int]:
        """Blocks each group holds now (null blocks not counted)."""
        null = self.null_block
        return [sum(1 for blocks in t.values() for b in blocks if b is not null) for t in self.tables]

    # --------------------------------------------- a blocked head (the shortcuts)
    def allocation_deficit(self, seq: Sequence, hits: Hit, hit: int, n: int, watermark: bool) -> int:
        """Blocks a waiting `seq` (no blocks held) lacks to take `hits` (`hit` tokens) and `n` new
        slots now: allocation fails iff this is positive (the whole-sequence gate, capped per
        window, or the chunk's own count; no window has blocks of it to give back)."""
        gate = self.num_blocks_to_allocate(seq, seq.num_tokens, hits, num_computed=hit, capped=True)
        chunk = self.num_blocks_to_allocate(seq, hit + n, hits, num_computed=hit)
        return max(gate, chunk) + (self.watermark_blocks if watermark else 0) - self.pool.num_free_blocks

    def watch_hit(self, seq: Sequence, hits: Hit) -> None:
        """Watch `seq`'s lookup, which found `hits`: it stays what it was while no key of its prefix
        is added in any group and no block of the hit is evicted (`kvcache.hit_watch`)."""
        bs, n = self.block_size, (seq.num_tokens - 1) // self.block_size
        keys = seq.hashes_upto(n * bs, bs)[:n] if self.enable_caching and n > 0 else []
        self.hit_watch.watch(keys, [b for t in hits for b in t if b is not self.null_block], self.pool.num_evictions)

    def hit_unchanged(self) -> bool:
        """Whether the watched lookup (`watch_hit`) would give the same blocks now."""
        return self.hit_watch.unchanged(self.pool.num_evictions)

    def caches_watched(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether caching `seq`'s full blocks within `num_tokens` may add a key of the watched lookup
        (`watch_hit`) in some group: any key among the blocks not yet cached in every group."""
        sid, bs = seq.seq_id, self.block_size
        lo, n_full = min(counts.get(sid, 0) for counts in self.num_cached), num_tokens // bs
        return lo < n_full and self.hit_watch.would_add(seq.hashes_upto(n_full * bs, bs)[lo:n_full])

    def num_skipped_blocks(self, seq: Sequence) -> int:
        """Blocks `remove_skipped_blocks(seq)` would take out now, at least what it frees: what a quiet step's
        visit may give a blocked head (`sim.engine.quiet`); a Mamba group's blocks all count (a bound)."""
        sid, null = seq.seq_id, self.null_block
        n = sum(end - lo for lo, end in self._skipped_spans(sid, seq.num_computed_tokens).values())
        states = [self.tables[g].get(sid) or [] for g in self._mamba]
        return n + sum(len(t) - t.count(null) for t in states)

    def group_metrics(self) -> list[dict]:
        """One record a group: its blocks in use at most (distinct blocks some request references),
        blocks its window (or Mamba state) let go of as requests advanced,
        the hit tokens the group alone offered (the hit every group agrees on is the least), and its
        cached blocks evicted to make room (a block counts for the group that last took it)."""
        return [{"peak_blocks": p, "blocks_freed_behind_window": f, "own_hit_tokens": h, "evicted_blocks": e}
                for p, f, h, e in zip(self.peak, self.freed_behind, self.own_hits, self.pool.evicted_by_group,
                                      strict=True)]

    def internal_fragmentation(self, seqs: list[Sequence]) -> int:
        """Allocated slots not holding a token, over the given live sequences, in one group (every
        group's table has the same length: the others hold as many, in pages of their layers)."""
        bs, tables = self.block_size, self.tables[0]
        return sum(max(0, len(tables.get(s.seq_id, ())) * bs - s.num_tokens) for s in seqs)
