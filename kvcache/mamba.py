"""A Mamba (state-space or gated-delta-net) group in vLLM 0.33's "align" cache mode: how its
blocks are taken and let go, and where a prefill chunk of such a model must end.

vLLM turns "align" on for every Mamba hybrid served with prefix caching
(vllm/model_executor/models/config.py `MambaModelConfig.verify_and_update_config`). Block i of
a request's Mamba table holds the state after (i + 1) x block_size tokens; a request keeps only
the blocks it still needs, nulls elsewhere (vllm/v1/core/single_type_kv_cache_manager.py
`MambaManager`, with the hash block size equal to the block size, as `vllm serve` has it for
Qwen3-Next: no sub-block hits, no copy-on-write, no speculative blocks):

- an allocation takes at most one block (the running state), two when the chunk exports a
  prefill checkpoint (FlashInfer's gated-delta-net prefill writes the state at the last block
  boundary before the prompt's end inside the chunk: `num_prefill_checkpoint_blocks` 1);
- the state two allocations back, and every block before the last computed token's, go back
  to the pool as the request advances (`remove_skipped_blocks`);
- a hit whose block was hashed during this scheduling step is not taken: the allocation is
  refused until the next step (`cached_blocks_this_step`);
- a chunk ends on a block boundary unless it finishes the prefill, and a finishing chunk stops
  at the last boundary before the end unless a checkpoint exports it
  (vllm/v1/core/sched/scheduler.py `Scheduler._mamba_block_aligned_split`, `aligned_chunk`).
"""

from __future__ import annotations

from kvsim.kvcache.block import KVCacheBlock
from kvsim.kvcache.block_pool import BlockPool


def checkpoint_position(num_tokens: int, block_size: int) -> int:
    """The last block boundary a prefill of `num_tokens` can resume from: its last token is
    recomputed for logits (vllm/v1/kv_cache_interface.py `get_mamba_prefill_checkpoint_position`,
    no EAGLE, no hash lookahead)."""
    return max(num_tokens - 1, 0) // block_size * block_size


def checkpoint_valid(start: int, end: int, position: int, block_size: int, alignment: int | None) -> bool:
    """Whether a chunk [start, end) can export the state at `position` from inside
    (`is_mamba_prefill_checkpoint_valid`, hash block size = block size)."""
    if alignment is None:
        return False
    return (start % block_size == 0
            and -(-end // block_size) - 2 > (start - 1) // block_size
            and start + block_size <= position
            and start < position < end
            and (position - start) % alignment == 0)


def aligned_chunk(start: int, n: int, num_prompt: int, num_tokens: int, junction: int, block_size: int,
                  alignment: int | None, max_prefill: int) -> int:
    """Tokens of the `n` asked for that a chunk from `start` may take (`_mamba_block_aligned_split`;
    0: none this step). `num_tokens`: the request's tokens now; `junction`: its shared-prefix
    boundary from its lookup (0: none); `alignment`: the prefill checkpoint's (None: the layers
    export none); `max_prefill`: the step's token limit, capped by `long_prefill_token_threshold`."""
    prefill_end = max(num_prompt, num_tokens - 1)
    if start >= prefill_end:
        return n
    bs = block_size
    last_cache = checkpoint_position(num_tokens, bs)
    end = start + n
    internal = end >= prefill_end and checkpoint_valid(start, end, checkpoint_position(prefill_end, bs), bs, alignment)
    if internal:
        last_cache = 0
    if end < prefill_end:
        aligned = end // bs * bs
        if aligned > start or bs <= max_prefill:
            end = aligned
    stops = ((start // bs + 1) * bs if start % bs and not internal else 0,
             last_cache,
             start + (junction - start) // bs * bs if start < junction < end else 0)
    end = min((s for s in stops if start < s < end), default=end)
    return max(end - start, 0)


class MambaAlign:
    """One Mamba group's per-request bookkeeping in "align" mode (see the module docstring):
    `pool` is the shared block pool; `alignment` the prefill checkpoint's (None: no checkpoint
    blocks, as on a GPU without FlashInfer's gated-delta-net prefill)."""

    def __init__(self, pool: BlockPool, block_size: int, alignment: int | None):
        self.pool, self.block_size, self.alignment = pool, block_size, alignment
        self.null = pool.null_block
        self.last_state: dict[str, int] = {}  # the state block of the previous allocation
        self.retired: dict[str, int] = {}  # blocks before this are let go already
        self.checkpoints: dict[str, tuple[int, int]] = {}  # this chunk's checkpoint: (position, block index)
        self.cached_this_step: set[int] = set()  # keys hashed in this scheduling step

    def blocks_to_allocate(self, sid: str, table: list[KVCacheBlock], num_tokens: int, hits: list[KVCacheBlock],
                           start: int, prefill_end: int, gate: bool) -> int:
        """Free blocks an allocation up to `num_tokens` slots takes (`MambaManager.
        get_num_blocks_to_allocate`): the running state, a checkpoint block, the hit if it is
        free; more than the pool when the hit was hashed this step. `gate`: the whole-sequence
        count, which records no checkpoint."""
        if hits and hits[-1].block_hash in self.cached_this_step:
            return self.pool.num_blocks + 1
        bs = self.block_size
        new = -(-num_tokens // bs) - len(hits) - len(table)
        position = checkpoint_position(num_tokens, bs)
        if not self._needs_checkpoint(table, start, num_tokens, position, prefill_end):
            position = 0
        if not gate:
            if position:
                self.checkpoints[sid] = (position, -(-num_tokens // bs) - 2)
            else:
                self.checkpoints.pop(sid, None)
        if new > 0:
            new = min(new, 1 + (position > 0))
        null = self.null
        return new + sum(1 for b in hits if b.ref_cnt == 0 and b is not null)

    def _needs_checkpoint(self, table: list[KVCacheBlock], start: int, end: int, position: int,
                          prefill_end: int) -> bool:
        idx = -(-end // self.block_size) - 2
        return (self.alignment is not None and end >= prefill_end
                and checkpoint_valid(start, end, position, self.block_size, self.alignment)
                and idx >= 0 and (idx >= len(table) or table[idx] is self.null))

    def allocate(self, sid: str, table: list[KVCacheBlock], num_tokens: int) -> list[KVCacheBlock]:
        """Give `table` its running state block for `num_tokens` slots (and the checkpoint's), nulls
        before them (`MambaManager.allocate_new_blocks`); returns the blocks taken."""
        need = -(-num_tokens // self.block_size)
        checkpoint = sid in self.checkpoints
        if need <= len(table) and not checkpoint:
            return []
        prev = len(table)
        if prev:
            self.last_state[sid] = prev - 1
        nulls = need - 1 - checkpoint - prev
        if nulls > 0:
            table.extend([self.null] * nulls)
        n = need - len(table)
        new = self.pool.get_new_blocks(n) if n > 0 else []
        table.extend(new)
        return new

    def decoded(self, sid: str, length: int, took: bool) -> None:
        """A decode token's allocation (`allocate_new_blocks` with no checkpoint: a 1-token chunk
        holds no boundary inside): `took`, the table (now `length` long) got its next state block."""
        self.checkpoints.pop(sid, None)
        if took:
            self.last_state[sid] = length - 2

    def skipped(self, sid: str, table: list[KVCacheBlock], processed: int) -> list[tuple[list[KVCacheBlock], list[int]]]:
        """Take out of `table` the blocks no longer needed at `processed` computed tokens: those
        before the last token's block not let go yet, last first, then the previous allocation's
        state (`MambaManager.remove_skipped_blocks`); returns them as the two frees vLLM makes,
        each with the table entries it nulled (for the op log's `table` ops)."""
        null, bs = self.null, self.block_size
        out = []
        if processed > 1:
            last = min((processed - 1) // bs, len(table))
            first = self.retired.get(sid, 0)
            if first < last:
                freed, entries = [], []
                for i in range(last - 1, first - 1, -1):
                    b = table[i]
                    if b is not null:
                        freed.append(b)
                        entries.append(i)
                        table[i] = null
                if freed:
                    out.append((freed, entries))
                self.retired[sid] = last
        i = self.last_state.get(sid)
        if i is not None and i < -(-processed // bs) - 1 and table[i] is not null:
            out.append(([table[i]], [i]))
            table[i] = null
        return out

    def checkpoint_key_kept(self, sid: str, table: list[KVCacheBlock], num_prompt: int, junction: int,
                            retention_interval: int | None) -> None:
        """After caching: a checkpoint that is neither the prompt's nor retained nor the junction
        holds a transient state, so its block's key is dropped (`MambaManager.
        _cache_partial_tail_block`; with the hash block size equal to the block size a kept one
        is hashed already)."""
        checkpoint = self.checkpoints.get(sid)
        if checkpoint is None:
            return
        position, idx = checkpoint
        block = table[idx]
        if position == checkpoint_position(num_prompt, self.block_size) or position == junction:
            return
        if retention_interval is None:
            return
        if retention_interval:
            per = retention_interval // self.block_size
            if per <= 1 or (position // self.block_size) % per == 0:
                return
        if block.block_hash is not None:
            self.pool.uncache(block)

    def forget(self, sid: str) -> None:
        """A request's blocks are popped (`MambaManager.pop_blocks_for_free`)."""
        self.last_state.pop(sid, None)
        self.retired.pop(sid, None)
        self.checkpoints.pop(sid, None)
