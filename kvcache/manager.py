"""The request-level block manager: lookup, allocate, append, fork, swap, free.

Its API and semantics follow vLLM V1's KVCacheManager: the scheduler asks
`get_computed_blocks` for a new request's cached prefix, then
`allocate_slots` for the tokens it schedules (and again every step it runs),
and `free` when the request finishes or is preempted by recompute. Fork with
copy-on-write, swapping to CPU blocks, sliding-window reclamation and the
watermark come from the v0/v2 managers (fork and swap are mixed in from
`kvcache.fork` and `kvcache.swap`). Every physical effect is an op in
`self.ops` (see `kvcache.ops`); callers use the public methods and properties.
"""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType

import numpy as np

from kvsim.kvcache import sliding_window as sw
from kvsim.kvcache.admission import AllocStatus, watermark_status
from kvsim.kvcache.block import KVCacheBlock
from kvsim.kvcache.block_pool import BlockPool, check_memory
from kvsim.kvcache.defrag import Defragmenter
from kvsim.kvcache.events import KVEventLog, TokenSpan
from kvsim.kvcache.eviction import EvictionPolicy, make_policy
from kvsim.kvcache.fork import Forking
from kvsim.kvcache.id_span import IdSpan
from kvsim.kvcache.loads import Loads
from kvsim.kvcache.ops import OpLog
from kvsim.kvcache.pool_view import PoolView
from kvsim.kvcache.profiles import DEFAULT_VERSION, profile
from kvsim.kvcache.sequence import Sequence
from kvsim.kvcache.swap import CpuPool, Swapping


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager(PoolView, Forking, Swapping, Loads):
    """Paged KV-cache block manager for one KV-cache group.

    num_gpu_blocks: as vLLM reports it; block 0 is the null block.
    watermark: fraction of GPU blocks kept free when admitting waiting requests.
    track_ids: keep the used-id map that id-space fragmentation and
    defragmentation need (off only for the fastest cache-only replays).
    defrag_threshold: run the online defragmenter (`defragment()`) when
    max_used_id - num_used exceeds it; None disables moves.
    prefix_cache_retention_interval: which of a sliding window's full blocks are hashed (vLLM's
    option: 0, its default, keeps only the tail a later request resumes from; N > 0 also a tail
    every N tokens; None every block; `sliding_window.retained_ranges`).
    vllm_version: the release whose rules to follow (see `kvcache.profiles`).
    kv_events: queue vLLM's KV events (`kvcache.events`) for `take_events`; off, nothing is queued.
    """

    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int,
        *,
        num_cpu_blocks: int = 0,
        enable_caching: bool = True,
        eviction: str | EvictionPolicy = "lru",
        watermark: float = 0.0,
        sliding_window: int | None = None,
        prefix_cache_retention_interval: int | None = 0,
        record_ops: bool = False,
        track_ids: bool = True,
        defrag_threshold: int | None = None,
        vllm_version: str = DEFAULT_VERSION,
        kv_events: bool = False,
    ):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        check_memory(num_gpu_blocks + num_cpu_blocks)
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}")
        self.profile = profile(vllm_version)
        self.profile.check_watermark(watermark)
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        # which of a window's full blocks are hashed (sliding_window.retained_ranges): vLLM's
        # prefix_cache_retention_interval, default 0 since 0.29 (dense, None, before)
        retention = prefix_cache_retention_interval if self.profile.sparse_retention else None
        if retention is not None and (retention < 0 or retention % block_size):
            raise ValueError(f"prefix_cache_retention_interval ({retention}) must be non-negative and a multiple "
                             f"of the block size ({block_size})")
        if retention and sliding_window is None:
            raise ValueError("prefix_cache_retention_interval is set but this cache has no sliding window, so "
                             "retention has no effect; set it to 0 (vLLM refuses it too)")
        self.retention_interval = retention if sliding_window is not None else None  # full attention: dense
        self.admission_tokens: int | None = None  # a window's admission cap (sliding_window.admission_blocks)
        self.ops = OpLog(record_ops)
        self.op_counts = MappingProxyType(self.ops.counts)  # kind -> ops so far (read-only, live)
        policy = make_policy(eviction, block_size) if isinstance(eviction, str) else eviction
        self.pool = BlockPool(num_gpu_blocks, enable_caching=enable_caching, policy=policy, ops=self.ops,
                              free_first=self.profile.free_first(enable_caching))
        self.null_block = self.pool.null_block
        self.events = self.pool.events = KVEventLog() if kv_events else None
        self.cpu = CpuPool(num_cpu_blocks)
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self.block_tables = MappingProxyType(self.req_blocks)  # sequence id -> its blocks (read-only, live)
        self.num_cached_block: dict[str, int] = {}
        # sequence id -> tokens whose full blocks are still to cache, all past its known tokens
        # (`defer_unique_caching`); None: each cache is made when asked
        self._owed: dict[str, int] | None = None
        self.swapped: dict[str, list[int]] = {}  # seq id -> CPU block ids (-1 for null)
        self.num_cow_copies = 0
        self.defrag: Defragmenter | None = None
        if defrag_threshold is not None:
            self.defrag = Defragmenter(num_gpu_blocks, defrag_threshold)
            self.pool.tracker = self.defrag
            self.ops.resolve = self.defrag.resolve
        elif track_ids:
            self.pool.tracker = IdSpan(self.pool.blocks)

    num_groups = 1  # KV-cache groups (kvcache.hybrid keeps several)

    @property
    def decode_shortcuts(self) -> bool:
        """Whether a decode token landing mid-block (not on a block's first or last slot) in an
        unshared block leaves the tables, the pool and the cache as they are (no window to slide)."""
        return self.sliding_window is None

    @property
    def async_decode_shortcuts(self) -> bool:
        """`decode_shortcuts` with the last token in flight (async output): a window lets go on the
        processed tokens, one behind, so one of whole blocks at a block's first slot (visited)."""
        return self.sliding_window is None or self.sliding_window % self.block_size == 0

    # ------------------------------------------------------------------ lookup
    def get_computed_blocks(self, seq: Sequence) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of `seq` in whole blocks, and its token count.

        At most `num_tokens - 1` tokens hit, so the last token is always
        recomputed (its logits are needed). Nothing is allocated or touched.
        """
        if not self.enable_caching:
            return [], 0
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        if max_blocks <= 0:
            return [], 0
        hashes = seq.hashes_upto(max_blocks * bs, bs)
        if self.sliding_window is not None:
            blocks = sw.find_longest_cache_hit(
                hashes, max_blocks, self.sliding_window, bs, self.pool.get_cached_block, self.null_block
            )
            return blocks, len(blocks) * bs
        cached = self.pool.cached
        blocks = []
        for i in range(max_blocks):
            hit = cached.get(hashes[i])
            if hit is None:
                break
            if type(hit) is not KVCacheBlock:
                hit = next(iter(hit.values()))
            blocks.append(hit)
        return blocks, len(blocks) * bs

    # -------------------------------------------------------------- allocation
    def num_blocks_to_allocate(self, seq: Sequence, num_tokens: int,
                               new_computed_blocks: list[KVCacheBlock] = ()) -> int:
        """Free blocks an allocation up to `num_tokens` slots would consume,
        counting cache hits that sit in the free set (taking them consumes it)."""
        blocks = self.req_blocks.get(seq.seq_id, ())
        n = max(0, cdiv(num_tokens, self.block_size) - len(blocks) - len(new_computed_blocks))
        n += self.pool.num_free_hits(new_computed_blocks, self.sliding_window is not None)
        if blocks and self._needs_cow(seq, blocks):
            n += 1
        return n

    def _needs_cow(self, seq: Sequence, blocks: list[KVCacheBlock]) -> bool:
        """True if the next write lands in a partial last block shared with a fork."""
        start = seq.num_computed_tokens
        return start % self.block_size != 0 and len(blocks) > start // self.block_size and \
            blocks[start // self.block_size].ref_cnt > 1

    def allocate_slots(
        self,
        seq: Sequence,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
        *,
        watermark: bool = False,
        full_sequence_must_fit: bool = False,
        in_flight: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` to be computed (plus lookahead slots).

        `new_computed_blocks` / `num_new_computed_tokens` are a new request's
        cache hit from `get_computed_blocks`. Returns the newly allocated
        blocks, or None (and changes nothing) if too few blocks are free.
        `watermark=True` (for a waiting or preempted request while any request
        is running) also keeps the watermark free. `full_sequence_must_fit`
        (vLLM's `scheduler_reserve_full_isl` admission gate) also asks that the
        blocks for all of the sequence's known tokens be free, not just the chunk's.
        `in_flight`: the request's scheduled tokens whose output is not applied yet (vLLM's
        `num_in_flight_tokens`, nonzero only under async scheduling): a sliding window lets its
        blocks go on the processed tokens, `computed - in_flight` (vLLM 0.33 `allocate_slots`).
        """
        if num_new_tokens == 1 and not new_computed_blocks and not num_lookahead_tokens \
                and self.sliding_window is None and not full_sequence_must_fit:
            decoded = self.decode_slot(seq, watermark)
            if decoded is not False:
                return decoded
        if num_new_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError(f"{seq.seq_id}: negative token count")
        new_computed_blocks = new_computed_blocks or []
        bs = self.block_size
        sid = seq.seq_id
        num_computed = seq.num_computed_tokens + num_new_computed_tokens
        num_slots = num_computed + num_new_tokens + num_lookahead_tokens
        blocks = self.req_blocks.get(sid)
        reserve = self.watermark_blocks if watermark else 0
        if full_sequence_must_fit and num_slots < seq.num_tokens:
            # NOTE: vllm/v1/core/kv_cache_manager.py allocate_slots: blocks for every known
            # token, hits counted, before the chunk's own check and before dead blocks go back
            if self.sliding_window is None:
                need = self.num_blocks_to_allocate(seq, seq.num_tokens, new_computed_blocks)
            else:
                need = sw.admission_blocks(seq.num_tokens, self.admission_tokens, self.sliding_window, bs,
                                           blocks or (), new_computed_blocks, num_computed, self.pool.num_free_hits)
            if need + reserve > self.pool.num_free_blocks:
                return None
        if blocks is not None and self.sliding_window is not None:
            # NOTE: as in vLLM V1, dead blocks go back even if this allocation then fails
            self._remove_skipped_blocks(sid, max(0, num_computed - in_flight))
        free = self.pool.num_free_blocks
        n_alloc = self.num_blocks_to_allocate(seq, num_slots, new_computed_blocks)
        if n_alloc + reserve > free:
            return None
        if blocks is None:
            blocks = self.req_blocks[sid] = []

        first_new_entry = len(blocks)
        if new_computed_blocks:
            if self.enable_caching:
                self.pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
        if sid not in self.num_cached_block:
            self.num_cached_block[sid] = len(new_computed_blocks)
        if blocks and num_new_tokens and self._needs_cow(seq, blocks):
            self._copy_on_write(seq, blocks)
        n_new = cdiv(num_slots, bs) - len(blocks)
        new_blocks = self.pool.get_new_blocks(n_new) if n_new > 0 else []
        blocks.extend(new_blocks)
        if self.ops.enabled:
            self.ops.emit_table(sid, blocks, first_new_entry)

        if num_new_tokens:
            self._emit_writes(sid, blocks, num_computed, num_computed + num_new_tokens)
        if self.enable_caching:
            self._cache_full_blocks(seq, blocks, min(num_computed + num_new_tokens, seq.num_tokens))
        return new_blocks

    def decode_slot(self, seq: Sequence, watermark: bool = False) -> list[KVCacheBlock] | None | bool:
        """`allocate_slots(seq, 1)` for a running sequence's decode token, with no lookahead
        or sliding window; returns False when the general path must decide (copy-on-write)."""
        blocks = self.req_blocks.get(seq.seq_id)
        if blocks is None:
            return False
        bs = self.block_size
        nc = seq.num_computed_tokens
        idx = nc // bs
        if idx < len(blocks):
            if nc % bs and blocks[idx].ref_cnt > 1:
                return False
            if watermark and self.pool.num_free_blocks < self.watermark_blocks:
                # NOTE: vllm/v1/core/kv_cache_manager.py allocate_slots asks a waiting request for the
                # watermark even when it needs no new block (a load landed: its last token is recomputed)
                return None
            new = []
        elif idx == len(blocks):
            free = self.pool.num_free_blocks
            if free < 1 or (watermark and free - 1 < self.watermark_blocks):
                return None
            block = self.pool.take_one()
            new = [block]
            blocks.append(block)
        else:
            return False
        if self.ops.enabled:
            block = blocks[idx].block_id
            if new:
                self.ops.emit_entry(seq.seq_id, block, idx)
            self.ops.emit_write(seq.seq_id, block, nc, bs)
        else:
            self.ops.counts["write"] += 1
        if self.enable_caching and (nc + 1) % bs == 0 and nc < seq.num_tokens:
            self._cache_full_blocks(seq, blocks, nc + 1)
        return new

    def _emit_writes(self, sid: str, blocks: list[KVCacheBlock], start: int, end: int) -> None:
        bs = self.block_size
        first, last = start // bs, (end - 1) // bs
        if not self.ops.enabled:
            self.ops.counts["write"] += last - first + 1
            return
        self.ops.emit_span(sid, [blocks[i].block_id for i in range(first, last + 1)], start, end, bs)

    def cache_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Cache `seq`'s full blocks within its first `num_tokens` tokens (vLLM `cache_blocks`)."""
        # (the count checked here first: the scheduler asks again each step under async output)
        sid = seq.seq_id
        if self.enable_caching and num_tokens // self.block_size > self.num_cached_block[sid]:
            owed = self._owed
            asked = owed.get(sid) if owed is not None else None
            if asked is not None:  # owed already (`_cache_full_blocks`: its count has not moved since)
                if num_tokens > asked:
                    owed[sid] = num_tokens
                return
            self._cache_full_blocks(seq, self.req_blocks[sid], num_tokens)

    @property
    def can_defer_unique_caching(self) -> bool:
        """Whether `defer_unique_caching` is exact here (see it)."""
        return self.events is None and not self.caching_hooks_policy and self.defrag is None \
            and self.num_groups == 1 and self.sliding_window is None

    def defer_unique_caching(self) -> None:
        """From now on, a cache whose blocks all hold a unique decoded token (past the sequence's
        known tokens) is owed, not made: made when the sequence's blocks are freed (`pop_blocks_for_free`).

        Exact where nothing can tell the two apart: such a block's key matches no other sequence's
        (nothing looks it up while its sequence holds it), the pool's free queue sees it only once
        freed, and then it is cached as before; caching records no op. Not with KV events (a
        `BlockStored` belongs to its step), an eviction policy that hooks caching (FIFO, ARC, ...),
        defragmentation, vLLM's hybrid groups, where the order of caches shows, or a sliding window,
        which frees a block it slides past while its sequence runs (cached, had it not been owed). What
        `LazyDecodes.fills` does for sync lazy decodes, here for every caller (the async output's
        schedule and update ask for each visited sequence's cache a step)."""
        if not self.can_defer_unique_caching:
            raise ValueError("deferred caching needs one group without a window, and no KV events, "
                             "defragmentation or caching hooks")
        self._owed = {}

    def _cache_full_blocks(self, seq: Sequence, blocks: list[KVCacheBlock], num_tokens: int,
                           owed: bool = True) -> None:
        sid = seq.seq_id
        n_full = num_tokens // self.block_size
        n_cached = self.num_cached_block[sid]
        if n_full <= n_cached:
            return
        bs = self.block_size
        if owed and self._owed is not None and n_cached >= seq.num_known_tokens // bs:
            if num_tokens > self._owed.get(sid, 0):  # (a smaller ask after a larger one caches nothing more)
                self._owed[sid] = num_tokens
            return
        hashes = seq.hashes_upto(n_full * bs, bs)
        chain = seq.num_prompt_tokens // bs
        if self.retention_interval is None:
            ranges = [(n_cached, n_full)]
        else:  # a sliding window hashes only the blocks a later request can resume from
            ranges = sw.retained_ranges(n_cached, n_full, (seq.num_prompt_tokens - 1,), self.sliding_window,
                                        bs, self.retention_interval)
        for a, b in ranges:
            self.pool.cache_blocks(blocks, hashes, a, b, chain)
        if self.events is not None:
            self.events.stored(blocks, hashes, ranges, n_cached, n_full,
                               TokenSpan(seq, n_cached * bs, n_full * bs), bs, self.null_block)
        self.num_cached_block[sid] = n_full

    def _remove_skipped_blocks(self, sid: str, num_computed: int) -> None:
        null = self.null_block
        removed = sw.null_skipped(self.req_blocks[sid], num_computed, self.sliding_window, self.block_size, null)
        if removed:
            for i in removed if self.ops.enabled else ():
                self.ops.emit_entry(sid, null.block_id, i)
            self.pool.free_blocks(list(removed.values()))

    # ------------------------------------------------------------------- free
    def free(self, seq: Sequence) -> None:
        """Release a finished or recompute-preempted sequence's blocks, tail first,
        so the block ending the longest prefix is evicted first."""
        self.free_popped(self.pop_blocks_for_free(seq))

    def pop_blocks_for_free(self, seq: Sequence) -> list[KVCacheBlock]:
        """Take a finished or preempted sequence's blocks out of its table without returning them to
        the pool (vLLM 0.33 `KVCacheManager.pop_blocks_for_free`: an in-flight step may still write
        them); `free_popped` returns them later."""
        blocks = self.req_blocks.pop(seq.seq_id, None)
        if blocks is None:
            raise KeyError(f"free of unknown sequence {seq.seq_id!r}")
        if self._owed:
            n = self._owed.pop(seq.seq_id, None)
            if n is not None:  # (before the pool sees them: freed cached, as if cached when asked)
                self._cache_full_blocks(seq, blocks, n, owed=False)
        self.num_cached_block.pop(seq.seq_id, None)
        if self.ops.enabled:
            self.ops.keep_sequence(seq)
        return blocks

    def free_popped(self, blocks: list[KVCacheBlock]) -> None:
        """Return blocks taken by `pop_blocks_for_free` to the pool, tail first (as `free`)."""
        self.pool.free_blocks(blocks[::-1])

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix if no sequence holds blocks (else False, nothing changes)."""
        if self.req_blocks:
            return False
        return self.pool.reset_prefix_cache()

    def block_ids(self, seq_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(seq_id, ())]

    # ------------------------------------------------------------- admission
    def can_allocate(self, seq: Sequence, num_lookahead_tokens: int = 0) -> AllocStatus:
        """v2 watermark admission for a waiting sequence's whole context."""
        n = cdiv(seq.num_tokens + num_lookahead_tokens, self.block_size)
        if self.sliding_window is not None:
            n = min(n, self.sliding_window // self.block_size + 2)
        return watermark_status(n, self.pool.num_free_blocks, self.pool.num_usable_blocks, self.watermark_blocks)

    # ---------------------------------------------------------------- defrag
    def defragment(self, before: Callable[[], object] | None = None) -> list[tuple[int, int]]:
        """Compact the used physical ids if the threshold is passed (calling `before()` first);
        emits `move` ops."""
        if self.defrag is None or not self.defrag.due():
            return []
        before is not None and before()
        moves = self.defrag.defragment()
        if moves:
            self.ops.emit_many("move", moves)
        return moves

    def physical_ids(self, seq_id: str) -> list[int]:
        """The sequence's block table as the hardware sees it (after defrag moves)."""
        ids = self.block_ids(seq_id)
        if self.defrag is None:
            return ids
        return self.defrag.resolve(np.asarray(ids, dtype=np.int64)).tolist()

    # ------------------------------------------------------ state and counters
    def num_cached_blocks_of(self, seq_id: str) -> int:
        """Of sequence `seq_id`'s blocks, how many are cached (in the prefix-cache map) so far."""
        return self.num_cached_block[seq_id]

    def decode_in_place(self, seqs: list[Sequence], num_new: int = 0) -> None:
        """Slots for the decode token of each of `seqs` (running, prompt done, one token to compute,
        at a block's first or last slot, unshared), in order: a new block where its token starts one,
        caching the block its token fills. No write is counted (the caller counts them in bulk).
        `num_new` > 0 (exact LRU only): the new blocks are taken in one go, which hands out the same
        blocks as a take each, since caching between them pushes, pops and touches no free block
        (not with KV events: a take's removals are queued between the cachings, sequence by sequence).
        With op records, `_decode_recorded` (a sequence may then be at any slot)."""
        if self.ops.enabled:
            self._decode_recorded(seqs, num_new)
            return
        bs, tables, caching = self.block_size, self.req_blocks, self.enable_caching
        # (with KV events a take each: a take's removals come between the cachings, as vLLM queues them)
        take = iter(self.pool.get_new_blocks(num_new)) if num_new and self.events is None else None
        for seq in seqs:
            c = seq.num_computed_tokens
            blocks = tables[seq.seq_id]
            if c // bs == len(blocks):
                blocks.append(next(take) if take is not None else self.pool.take_one())
            if caching and (c + 1) % bs == 0:
                self._cache_full_blocks(seq, blocks, c + 1)

    def _decode_recorded(self, seqs: list[Sequence], num_new: int) -> None:
        """`decode_slot` for each of `seqs` in order (any slot, unshared; each write recorded and
        counted), with the new blocks taken in one go as `decode_in_place` takes them (unless kv
        events are kept: those of the takes would come ahead of the caching between them). The
        rows are `decode_slot`'s, sequence by sequence: a new block's eviction (its key kept at the
        take), its table entry, then the write."""
        bs, tables, caching, ops, pool = self.block_size, self.req_blocks, self.enable_caching, self.ops, self.pool
        keys: list[int | None] = []
        taken = pool.get_new_blocks(num_new, keys) if num_new and self.events is None else None
        i = 0  # the next of `taken`
        edges = evicts = 0  # what `record_edge` recorded (one run a new block's rows), counted after the loop
        for seq in seqs:
            c, sid = seq.num_computed_tokens, seq.seq_id
            blocks = tables[sid]
            idx = c // bs
            if idx == len(blocks):
                if taken is None:
                    keys = []
                    block = pool.get_new_blocks(1, keys)[0]
                    key = keys[0]
                else:
                    block, key = taken[i], keys[i]
                    i += 1
                blocks.append(block)
                ops.record_edge(sid, block.block_id, idx, c, bs, key)
                edges += 1
                evicts += key is not None
            else:
                ops.emit_write(sid, blocks[idx].block_id, c, bs)
            if caching and (c + 1) % bs == 0:
                self._cache_full_blocks(seq, blocks, c + 1)
        if edges:
            counts = ops.counts
            counts["table"] += edges
            counts["write"] += edges
            if evicts:
                counts["evict"] += evicts

    def record_loaded(self, seq: Sequence, start: int, end: int) -> None:
        """With op records, the `write` ops of `seq`'s positions [start, end), whose KV a connector's
        read landed in its blocks (P/D disaggregation's decode side, `sim.engine.nixl`), so a replay
        holds it; without records, nothing (the read is no computed write: it is not counted)."""
        if self.ops.enabled and end > start:
            counted = self.ops.counts["write"]
            self._emit_writes(seq.seq_id, self.req_blocks[seq.seq_id], start, end)
            self.ops.counts["write"] = counted  # (recorded, not counted)

    def record_decodes(self, seq: Sequence, pos: int, step: int, n: int) -> None:
        """Record (not count) `n` one-token writes of `seq` from position `pos` on, in one block, the
        i-th at step `step + i`: late, by at most `ops.lag` steps (`OpLog.late_writes`)."""
        bs = self.block_size
        self.ops.late_writes(seq.seq_id, self.req_blocks[seq.seq_id][pos // bs].block_id, step, n, pos % bs, pos)

    def holds_blocks(self, seq_id: str) -> bool:
        """Whether sequence `seq_id` holds GPU blocks (running, or loading from the host tier)."""
        return seq_id in self.req_blocks

    # ---------------------------------------------------------------- metrics
    def internal_fragmentation(self, seqs: list[Sequence]) -> int:
        """Allocated slots not holding a token, over the given live sequences."""
        bs, tables, total = self.block_size, self.req_blocks, 0
        for s in seqs:  # (a plain loop: asked over every running sequence each step under async output)
            f = len(tables.get(s.seq_id, ())) * bs - s.num_tokens
            if f > 0:
                total += f
        return total
