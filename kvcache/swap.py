"""Preemption by swapping (v0/v2): a sequence's blocks move to CPU blocks and back.

vLLM V1 has no swapping; its v0 block manager kept it apart from allocation,
and so does this module: the CPU pool, and the swap half of `KVCacheManager`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvsim.kvcache.admission import AllocStatus, watermark_status
from kvsim.kvcache.block import KVCacheBlock
from kvsim.kvcache.block_pool import OutOfBlocksError
from kvsim.kvcache.sequence import Sequence

if TYPE_CHECKING:
    from kvsim.kvcache.block_pool import BlockPool
    from kvsim.kvcache.events import KVEventLog
    from kvsim.kvcache.ops import OpLog


class CpuPool:
    """CPU blocks 0..n-1 with ref counts; a stack of free ids, as in vLLM's first allocator."""

    def __init__(self, num_blocks: int):
        if num_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfBlocksError(f"out of CPU blocks ({self.num_blocks} in all)")
        cpu = self._free.pop()
        self.ref[cpu] = 1
        return cpu

    def share(self, cpu: int) -> None:
        self.ref[cpu] += 1

    def free(self, cpu: int) -> None:
        if not 0 <= cpu < self.num_blocks:
            raise ValueError(f"unknown CPU block {cpu}")
        if self.ref[cpu] <= 0:
            raise ValueError(f"double free of CPU block {cpu}")
        self.ref[cpu] -= 1
        if self.ref[cpu] == 0:
            self._free.append(cpu)


class Swapping:
    """The swap methods of `KVCacheManager` (mixed in): they move whole sequences between
    its block tables and `cpu`, and record each copy as a `swap_out` / `swap_in` op."""

    # set by KVCacheManager.__init__
    block_size: int
    enable_caching: bool
    pool: BlockPool
    null_block: KVCacheBlock
    ops: OpLog
    events: KVEventLog | None
    cpu: CpuPool
    watermark_blocks: int
    req_blocks: dict[str, list[KVCacheBlock]]
    num_cached_block: dict[str, int]
    swapped: dict[str, list[int]]  # seq id -> CPU block ids (-1 for null)

    def can_swap_in(self, seqs: list[Sequence], num_lookahead_tokens: int = 0) -> AllocStatus:
        """v2 watermark admission for bringing a swapped group back (plus lookahead slots)."""
        cpu_ids = {c for s in seqs for c in self.swapped[s.seq_id] if c >= 0}
        n = len(cpu_ids) + len(seqs) * -(-(num_lookahead_tokens + 1) // self.block_size)
        return watermark_status(n, self.pool.num_free_blocks, self.pool.num_usable_blocks, self.watermark_blocks)

    def can_swap_out(self, seqs: list[Sequence]) -> bool:
        """True if the CPU pool has room for the group's blocks (shared blocks once)."""
        ids = {b.block_id for s in seqs for b in self.req_blocks[s.seq_id] if b is not self.null_block}
        return len(ids) <= self.cpu.num_free_blocks

    def swap_out(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """Move a group's blocks to CPU (shared blocks once) and free them on GPU."""
        if not self.can_swap_out(seqs):
            raise OutOfBlocksError(f"not enough CPU blocks to swap out {[s.seq_id for s in seqs]}")
        mapping: dict[int, int] = {}
        for seq in seqs:
            blocks = self.req_blocks.pop(seq.seq_id)
            self.num_cached_block.pop(seq.seq_id, None)
            cpu_ids = []
            for b in blocks:
                if b is self.null_block:
                    cpu_ids.append(-1)
                    continue
                cpu = mapping.get(b.block_id)
                if cpu is None:
                    cpu = mapping[b.block_id] = self.cpu.allocate()
                    self.ops.emit("swap_out", b.block_id, cpu, seq=seq.seq_id)
                else:
                    self.cpu.share(cpu)
                cpu_ids.append(cpu)
            self.swapped[seq.seq_id] = cpu_ids
            self.pool.free_blocks(blocks[::-1])
            if self.ops.enabled:
                self.ops.keep_sequence(seq)
        return list(mapping.items())

    def drop_swapped(self, seq: Sequence) -> None:
        """Discard a swapped-out sequence: its CPU blocks go back to the CPU pool."""
        cpu_ids = self.swapped.pop(seq.seq_id, None)
        if cpu_ids is None:
            raise KeyError(f"sequence {seq.seq_id!r} is not swapped out")
        for cpu in cpu_ids:
            if cpu >= 0:
                self.cpu.free(cpu)

    def swap_in(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """Bring a swapped group back. A full block whose prefix is still cached
        on GPU is reused without a copy; the others are copied into new blocks."""
        if self.can_swap_in(seqs) is AllocStatus.NEVER:
            raise OutOfBlocksError(f"swap-in of {[s.seq_id for s in seqs]} can never fit")
        mapping: dict[int, KVCacheBlock] = {}
        copies = []
        bs = self.block_size
        for seq in seqs:
            cpu_ids = self.swapped.pop(seq.seq_id)
            n_full = min(seq.num_computed_tokens, seq.num_tokens) // bs
            hashes = seq.hashes_upto(n_full * bs, bs) if self.enable_caching else []
            blocks = []
            copied = []
            for i, cpu in enumerate(cpu_ids):
                if cpu < 0:
                    blocks.append(self.null_block)
                    continue
                b = mapping.get(cpu)
                if b is not None:
                    b.ref_cnt += 1
                elif i < n_full and self.enable_caching and (hit := self.pool.get_cached_block(hashes[i])):
                    self.pool.touch([hit])
                    b = mapping[cpu] = hit
                else:
                    (b,) = self.pool.get_new_blocks(1)
                    mapping[cpu] = b
                    self.ops.emit("swap_in", cpu, b.block_id, seq=seq.seq_id)
                    copies.append((cpu, b.block_id))
                    if i < n_full and self.enable_caching:
                        copied.append(i)
                blocks.append(b)
                self.cpu.free(cpu)
            for i in copied:
                self.pool.cache_blocks(blocks, hashes, i, i + 1, seq.num_prompt_tokens // bs)
                if self.events is not None:  # (v0's swap-in: no vLLM V1 rule, an event a block re-cached)
                    self.events.stored(blocks, hashes, [(i, i + 1)], i, i + 1,
                                       seq.token_ids(i * bs, (i + 1) * bs).tolist(), bs, self.null_block)
            self.req_blocks[seq.seq_id] = blocks
            if self.ops.enabled:
                self.ops.emit_table(seq.seq_id, blocks)
            self.num_cached_block[seq.seq_id] = n_full if self.enable_caching else 0
        return copies
