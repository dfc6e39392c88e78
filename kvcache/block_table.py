"""The worker-side block table: per-request rows of block ids and the batch slot mapping.

Modelled on vLLM V1's worker `BlockTable`. Rows hold *allocation* block ids (what
the manager hands out); when the attention kernel uses a smaller block size, each
allocation block b is also written out as kernel blocks b*k .. b*k+k-1 into `table`,
the matrix the GPU reads. `remap` rewrites the allocation ids and re-expands, so a
defragmenter's id permutation never has to be inverted through the kernel split.

    ids   (allocation level)   [3, 7]
    table (kernel level, k=2)  [6, 7, 14, 15, 0, 0, ...]   padding is 0 (null block)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class BlockTable:
    """Rows of block ids for up to `max_num_reqs` requests, plus slot mapping."""

    def __init__(
        self,
        block_size: int,
        max_num_reqs: int,
        max_num_blocks_per_req: int,
        max_num_batched_tokens: int,
        kernel_block_size: int | None = None,
        cp_world_size: int = 1,
        cp_rank: int = 0,
        cp_interleave: int = 1,
    ):
        kernel_block_size = block_size if kernel_block_size is None else kernel_block_size
        if block_size <= 0 or kernel_block_size <= 0 or block_size % kernel_block_size:
            raise ValueError(
                f"kernel_block_size {kernel_block_size} must be positive and divide "
                f"block_size {block_size}"
            )
        if cp_world_size < 1 or not 0 <= cp_rank < cp_world_size:
            raise ValueError(f"cp_rank {cp_rank} not in [0, cp_world_size {cp_world_size})")
        if cp_interleave < 1 or kernel_block_size % cp_interleave:
            raise ValueError(
                f"cp_interleave {cp_interleave} must be positive and divide "
                f"the kernel block size {kernel_block_size}"
            )
        self.alloc_block_size = block_size
        self.block_size = kernel_block_size  # the size slots are counted in, as vLLM
        self.blocks_per_alloc_block = block_size // kernel_block_size
        self.max_num_reqs = max_num_reqs
        self.max_num_blocks_per_req = max_num_blocks_per_req
        self.max_num_batched_tokens = max_num_batched_tokens
        self.cp_world_size = cp_world_size
        self.cp_rank = cp_rank
        self.cp_interleave = cp_interleave

        k = self.blocks_per_alloc_block
        self.ids = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int32)
        # NOTE: without a kernel split `table` *is* `ids` (one array, no copy to sync).
        self.table = self.ids if k == 1 else np.zeros(
            (max_num_reqs, max_num_blocks_per_req * k), dtype=np.int32
        )
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)
        self._kernel_arange = np.arange(k, dtype=np.int32)

    @property
    def num_kernel_blocks_per_row(self) -> np.ndarray:
        """Valid entries of each `table` row (allocation blocks times the split)."""
        return self.num_blocks_per_row * self.blocks_per_alloc_block

    def row(self, row: int) -> np.ndarray:
        """A view of the valid allocation block ids of `row`."""
        self._check_row(row)
        return self.ids[row, : self.num_blocks_per_row[row]]

    def append_row(self, block_ids: Sequence[int] | np.ndarray, row: int) -> None:
        """Append allocation block ids to the end of `row`."""
        self._check_row(row)
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        n = ids.size
        if n == 0:
            return
        start = int(self.num_blocks_per_row[row])
        if start + n > self.max_num_blocks_per_req:
            raise ValueError(
                f"row {row} holds {start} blocks; appending {n} exceeds "
                f"max_num_blocks_per_req {self.max_num_blocks_per_req}"
            )
        if ids.min() < 0:
            raise ValueError(f"negative block id {int(ids.min())} appended to row {row}")
        self.ids[row, start : start + n] = ids
        self.num_blocks_per_row[row] = start + n
        self._expand(row, start, start + n)

    def add_row(self, block_ids: Sequence[int] | np.ndarray, row: int) -> None:
        """Replace `row` with `block_ids` (a newly scheduled request)."""
        self.clear_row(row)
        self.append_row(block_ids, row)

    def clear_row(self, row: int) -> None:
        """Empty `row`; its entries go back to the null block 0."""
        self._check_row(row)
        self.ids[row] = 0
        self.table[row] = 0
        self.num_blocks_per_row[row] = 0

    def move_row(self, src: int, dst: int) -> None:
        """Copy row `src` into row `dst` (batch condensation); `src` is left as is."""
        self._check_row(src)
        self._check_row(dst)
        self.ids[dst] = self.ids[src]
        if self.table is not self.ids:
            self.table[dst] = self.table[src]
        self.num_blocks_per_row[dst] = self.num_blocks_per_row[src]

    def swap_row(self, a: int, b: int) -> None:
        """Exchange rows `a` and `b` (batch reordering)."""
        self._check_row(a)
        self._check_row(b)
        ab, ba = [a, b], [b, a]
        self.ids[ab] = self.ids[ba]
        if self.table is not self.ids:
            self.table[ab] = self.table[ba]
        self.num_blocks_per_row[ab] = self.num_blocks_per_row[ba]

    def clear(self) -> None:
        """Empty every row."""
        self.ids[:] = 0
        self.table[:] = 0
        self.num_blocks_per_row[:] = 0

    def remap(self, mapping: np.ndarray) -> None:
        """Rewrite every valid allocation id b as `mapping[b]` in place (after defrag moves)."""
        mapping = np.asarray(mapping)
        if mapping.ndim != 1 or not np.issubdtype(mapping.dtype, np.integer):
            raise ValueError(f"mapping must be a 1-D integer array, got {mapping.dtype} {mapping.shape}")
        valid = np.arange(self.max_num_blocks_per_req) < self.num_blocks_per_row[:, None]
        if not valid.any():
            return
        old = self.ids[valid]
        if old.max() >= mapping.size:
            raise ValueError(f"block id {int(old.max())} is outside mapping of size {mapping.size}")
        self.ids[valid] = mapping[old]
        k = self.blocks_per_alloc_block
        if k > 1:
            kernel = (self.ids[:, :, None] * k + self._kernel_arange).reshape(self.max_num_reqs, -1)
            self.table[:] = np.where(np.repeat(valid, k, axis=1), kernel, 0)

    def compute_slot_mapping(self, req_indices: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Slot of each (row, position) token: block_id * block_size + offset; -1 if not this CP rank's.

        `block_size` is the kernel block size. With context parallelism the rows hold
        this rank's blocks and tokens are dealt round-robin, `cp_interleave` at a time,
        across `cp_world_size` ranks within a virtual block of block_size * W tokens.
        """
        req = np.asarray(req_indices, dtype=np.int64).reshape(-1)
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        self._check_tokens(req, pos)
        bs, w, il = self.block_size, self.cp_world_size, self.cp_interleave
        virtual = bs * w
        width = self.table.shape[1]
        block_numbers = self.table.ravel()[req * width + pos // virtual].astype(np.int64)
        if w == 1:
            return block_numbers * bs + pos % bs
        voff = pos % virtual
        local = voff // il % w == self.cp_rank
        offsets = voff // (w * il) * il + voff % il
        return np.where(local, block_numbers * bs + offsets, -1)

    def _expand(self, row: int, start: int, end: int) -> None:
        """Write allocation entries [start, end) of `row` out as kernel block ids."""
        k = self.blocks_per_alloc_block
        if k == 1:
            return
        kernel = self.ids[row, start:end, None] * k + self._kernel_arange
        self.table[row, start * k : end * k] = kernel.reshape(-1)

    def _check_row(self, row: int) -> None:
        if not 0 <= row < self.max_num_reqs:
            raise IndexError(f"row {row} out of range [0, max_num_reqs {self.max_num_reqs})")

    def _check_tokens(self, req: np.ndarray, pos: np.ndarray) -> None:
        if req.shape != pos.shape:
            raise ValueError(f"req_indices {req.shape} and positions {pos.shape} differ in shape")
        if req.size > self.max_num_batched_tokens:
            raise ValueError(
                f"{req.size} tokens exceed max_num_batched_tokens {self.max_num_batched_tokens}"
            )
        if req.size == 0:
            return
        if req.min() < 0 or req.max() >= self.max_num_reqs:
            bad = int(req[(req < 0) | (req >= self.max_num_reqs)][0])
            raise IndexError(f"row {bad} out of range [0, max_num_reqs {self.max_num_reqs})")
        tokens_per_block = self.block_size * self.cp_world_size
        capacity = self.num_kernel_blocks_per_row[req].astype(np.int64) * tokens_per_block
        bad = np.flatnonzero((pos < 0) | (pos >= capacity))
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"position {int(pos[i])} of row {int(req[i])} is outside its "
                f"{int(self.num_blocks_per_row[req[i]])} blocks ({int(capacity[i])} tokens)"
            )
