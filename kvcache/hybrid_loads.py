"""Slots for KV a connector loads into vLLM 0.33's hybrid groups (P/D disaggregation's decode side);
mixed into `HybridKVCacheManager`, as `kvcache.loads` is into the one-group manager.

A request whose prompt a prefill replica computed gets, at once, every group's blocks for its local
hit plus the loaded tokens; nothing is cached until the load lands (vllm/v1/core/kv_cache_manager.py
`allocate_slots` with `num_external_computed_tokens` and `delay_cache_blocks`). Each group counts
the tokens it skips from the hit and the loaded tokens together
(kv_cache_coordinator.py `allocate_new_computed_blocks`, single_type_kv_cache_manager.py
`add_local_computed_blocks` then `allocate_external_computed_blocks`): a sliding window's table
gets null blocks for what its window no longer reads, its hit blocks past them, and new blocks only
for the loaded tokens inside the window; every group's hits are taken before any group's new blocks.
A Mamba group counts every token but the last as skipped: it gets null blocks and one new block, the
running state the load writes; its own hit blocks are counted by the allocation's check but never taken.

The local lookup a connector that completes divergent hits asks for (vLLM's NIXL connector:
connector.py `supports_divergent_local_hybrid_hits`) is `get_computed_blocks_for_connector`: with Mamba
state, each group looked up alone, full attention's hit taken as the local prefix with each group's own
blocks (kv_cache_manager.py `get_computed_blocks_for_connector`, kv_cache_coordinator.py
`find_longest_cache_hit_per_group`); the scheduler falls back to the reconciled lookup when the
connector then loads nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvsim.kvcache.block import KVCacheBlock
from kvsim.kvcache.groups import GroupSpec, find_longest_cache_hit, group_lookup
from kvsim.kvcache.sequence import Sequence

if TYPE_CHECKING:
    from kvsim.kvcache.block_pool import BlockPool
    from kvsim.kvcache.ops import OpLog

Hit = tuple[list[KVCacheBlock], ...]  # one list of hit blocks a group


class HybridLoads:
    """The connector-facing methods of `HybridKVCacheManager` (mixed in): its lookup and its loads."""

    # set by HybridKVCacheManager.__init__
    block_size: int
    pool: BlockPool
    ops: OpLog
    watermark_blocks: int
    has_mamba: bool
    null_block: KVCacheBlock
    tables: tuple[dict[str, list[KVCacheBlock]], ...]
    empty_hit: tuple[list[KVCacheBlock], ...]
    enable_caching: bool
    salts: tuple[int, ...]
    spec_groups: list[tuple[GroupSpec, list[int]]]
    junctions: dict[str, int]
    _own: dict[str, list[int]]
    _group_of: list[int]
    _mamba: dict[int, Any]

    if TYPE_CHECKING:
        def get_computed_blocks(self, seq: Sequence) -> tuple[Hit, int]: ...  # (HybridKVCacheManager's)

    def get_computed_blocks_for_connector(self, seq: Sequence) -> tuple[Hit, int, bool]:
        """The local hit a connector completing divergent hits is given (vllm/v1/core/kv_cache_manager.py
        `get_computed_blocks_for_connector`): with Mamba state and a full-attention group, each group
        looked up alone up to `num_tokens - 1` (kv_cache_coordinator.py `find_longest_cache_hit_per_group`),
        full attention's hit as the local prefix with each group's own hit blocks, and whether a group
        lags behind it (`hit_diverged`); the reconciled `get_computed_blocks` (not diverged) without
        Mamba state or full attention, or where a group hit deeper than full attention. A divergent
        hit records no shared-prefix junction."""
        first_spec, first_ids = self.spec_groups[0]
        if not self.has_mamba or first_spec.kind != "full" or not self.enable_caching:
            return *self.get_computed_blocks(seq), False
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        if max_blocks <= 0:
            return *self.get_computed_blocks(seq), False
        keys = seq.hashes_upto(max_blocks * bs, bs)
        get, null, salts = self.pool.get_cached_block, self.null_block, self.salts
        blocks: list[list[KVCacheBlock]] = [[] for _ in self.tables]
        lengths = [0] * len(self.tables)
        for spec, ids in self.spec_groups:
            found, length = find_longest_cache_hit(spec, max_blocks * bs, group_lookup(get, keys, [salts[g] for g in ids]),
                                                   len(ids), null)
            for g, table in zip(ids, found, strict=True):
                blocks[g], lengths[g] = table, length
        local = lengths[first_ids[0]]
        if max(lengths) > local:  # (full attention's blocks evicted under a deeper state: reconcile)
            return *self.get_computed_blocks(seq), False
        self.junctions[seq.seq_id] = 0
        self._own[seq.seq_id] = lengths
        return tuple(blocks), local, min(lengths) < local

    def allocate_for_load(self, seq: Sequence, hit: int, hit_blocks: tuple[list[KVCacheBlock], ...], loaded: int, *,
                          reserved: int = 0, watermark: bool = False, whole: bool = True) -> list[KVCacheBlock] | None:
        """Every group's blocks for `seq`'s `hit` cached tokens (`hit_blocks`, a list a group) and the
        next `loaded` tokens, none computed here; None (nothing changes) unless the whole sequence
        fits the free blocks (each window at its admission cap, plus the watermark; not asked when
        `whole` is False) and this allocation fits them less `reserved`. Returns the new blocks,
        group by group: the load's destinations, which are what vLLM's NIXL connector reads
        (`KVCacheBlocks.get_unhashed_block_ids_all_groups`: the request's blocks less hits and nulls)."""
        sid = seq.seq_id
        if sid in self.tables[0]:
            raise ValueError(f"{sid}: already holds blocks")
        total = hit + loaded
        hits = hit_blocks or self.empty_hit
        free = self.pool.num_free_blocks
        mark = self.watermark_blocks if watermark else 0
        if whole and self.num_blocks_to_allocate(seq, seq.num_tokens, hits, num_computed=total, capped=True) \
                + mark > free:
            return None
        if self.num_blocks_to_allocate(seq, total, hits, num_computed=total) + mark > free - reserved:
            return None
        self._add_hits(sid, hits, total)  # (every group's hits touched first, nulls for the skipped)
        need = -(-total // self.block_size)
        new: list[KVCacheBlock] = []
        for g, tables in enumerate(self.tables):
            table = tables[sid]
            got = self.pool.get_new_blocks(max(0, need - len(table)))
            table.extend(got)
            new.extend(got)
            self._hold(g, len(got))
            if self.ops.enabled:
                for b in got:  # (a recorded op names its block's group)
                    self._group_of[b.block_id] = g
                self.ops.emit_table(sid, table, 0, group=g)
        return new

    def record_loaded(self, seq: Sequence, start: int, end: int) -> None:
        """With op records, the writes a landed read made into `seq`'s blocks for positions [start,
        end) (the tokens past its local hit), group by group, so a replay holds that KV: an attention
        group's loaded blocks, from the first that is no null block (a window's table holds nulls for
        what it no longer reads: those were never read); a Mamba group's one state block, as a write
        of position end - 1 (the state after `end` tokens). Recorded, not counted: a read is no computed
        write (`KVCacheManager.record_loaded`, one group's)."""
        if not self.ops.enabled or end <= start:
            return
        ops, bs, null, sid = self.ops, self.block_size, self.null_block, seq.seq_id
        counted = ops.counts["write"]
        last = (end - 1) // bs
        for g, tables in enumerate(self.tables):
            table = tables[sid]
            if g in self._mamba:
                ops.emit_span(sid, [table[last].block_id], end - 1, end, bs, g)
                continue
            first = start // bs
            while first <= last and table[first] is null:
                first += 1
            if first <= last:
                ops.emit_span(sid, [table[i].block_id for i in range(first, last + 1)], max(start, first * bs), end,
                              bs, g)
        ops.counts["write"] = counted

    def blocks_to_finish(self, seq: Sequence) -> int:
        """Free blocks `seq` still needs to hold all its known tokens, each window at its admission
        cap (vLLM `Scheduler._request_remaining_blocks`, `apply_admission_cap=True`)."""
        return self.num_blocks_to_allocate(seq, seq.num_tokens, capped=True)

    def num_held_blocks(self, seq_id: str) -> int:
        """The blocks `seq_id` holds over every group, null blocks not counted."""
        null = self.null_block
        return sum(1 for tables in self.tables for b in tables.get(seq_id, ()) if b is not null)
