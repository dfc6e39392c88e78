"""What a block manager shows of its pool and its op log, the same for one group or several.

`kvcache.manager.KVCacheManager` (one group) and `kvcache.hybrid.HybridKVCacheManager` (vLLM's
hybrid groups over one pool) both hold a `BlockPool` as `pool` and an `OpLog` as `ops`; the
scheduler, the speed shortcuts and the metrics read the pool's state and stamp the ops through
these methods, never through the pool itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice
from pathlib import Path

from kvsim.kvcache.block import KVCacheBlock
from kvsim.kvcache.block_pool import BlockPool
from kvsim.kvcache.events import KVEvent
from kvsim.kvcache.eviction import LRU
from kvsim.kvcache.ops import OpLog


class PoolView:
    """The pool's and op log's state, read-only but for op stamping (mixed into both managers)."""

    pool: BlockPool
    ops: OpLog

    @property
    def emits_events(self) -> bool:
        """Whether the manager queues vLLM's KV events (`kvcache.events`; its `kv_events` argument)."""
        return self.pool.events is not None

    def take_events(self) -> list[KVEvent]:
        """The KV events queued since the last take, oldest first (vLLM's
        `KVCacheManager.take_events`); none when events are off."""
        events = self.pool.events
        return events.take() if events is not None else []

    def id_space_fragmentation(self) -> int:
        """Holes below the highest used physical id: max_used_id - num_used."""
        tracker = self.pool.tracker
        return tracker.fragmentation() if tracker is not None else 0

    @property
    def num_blocks(self) -> int:
        """GPU blocks as vLLM reports them (block 0, the null block, included)."""
        return self.pool.num_blocks

    @property
    def num_usable_blocks(self) -> int:
        """Blocks sequences can hold: all but the null block."""
        return self.pool.num_usable_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take now (idle cached blocks included)."""
        return self.pool.num_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a cached prefix (the evictable ones)."""
        return self.pool.num_cached_free

    @property
    def free_order_is_lru(self) -> bool:
        """Whether free blocks are handed out in the order of vLLM's free queue alone (exact LRU)."""
        return type(self.pool.policy) is LRU

    def next_free_blocks(self, n: int) -> Iterator[KVCacheBlock]:
        """The first `n` blocks an allocation would take now (exact LRU only: `free_order_is_lru`)."""
        if not self.free_order_is_lru:
            raise ValueError(f"next_free_blocks needs exact LRU, not {type(self.pool.policy).__name__}")
        return islice(self.pool.policy.queue, n)

    @property
    def caching_hooks_policy(self) -> bool:
        """Whether the eviction policy hears of each block cached (so caching must stay in its step)."""
        return self.pool.policy_sees_caching

    def is_cached(self, block_hash: int) -> bool:
        """True if a block with this hash is in the prefix cache."""
        return block_hash in self.pool.cached

    def count_writes(self, n: int) -> None:
        """Count `n` decode writes the caller applied without `allocate_slots` (negative: taken back)."""
        self.ops.counts["write"] += n

    @property
    def op_step(self) -> int:
        """The step number ops are being stamped with now (`set_step`)."""
        return self.ops.step

    def keep_late_ops(self, steps: int) -> None:
        """Let ops arrive up to `steps` steps late (lazy decodes' writes), before rows are final."""
        self.ops.lag = steps

    def stream_ops(self, folder: str | Path, *, process: bool = False, share: int = 1) -> None:
        """Stream the op records into `folder` as they become final (see `OpLog.stream_to`)."""
        self.ops.stream_to(folder, process=process, share=share)

    @property
    def op_log(self) -> OpLog:
        """The op stream, for the host tier's transfers recorded beside the manager's own ops."""
        return self.ops

    @property
    def records_ops(self) -> bool:
        """True if every op is recorded, not just counted (`record_ops`)."""
        return self.ops.enabled

    def set_step(self, step: int, output: bool = False) -> None:
        """Stamp the ops that follow with engine step `step`; `output`: its output's ops, not its
        schedule's (where a lazy decode's late write goes: `OpLog.set_step`)."""
        if self.ops.enabled:
            self.ops.set_step(step, output)  # may cut a chunk
        else:
            self.ops.step = step

    def finish_ops(self) -> None:
        """The run is over: hand every pending op and token id to a streamed log's writer now, so it
        encodes them while the run's tables are made (`save_ops` then only waits for it)."""
        self.ops.finish()

    def save_ops(self, folder: str | Path) -> None:
        """Write the recorded ops and each sequence's tokens into `folder` (`OpLog.save`)."""
        self.ops.save(folder)

    def num_used_blocks(self) -> int:
        """Blocks not in the free set (referenced, or pinned and idle)."""
        return self.pool.num_usable_blocks - self.pool.num_free_blocks
