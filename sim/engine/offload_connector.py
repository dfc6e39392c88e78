"""KV offloading as the scheduler's KV connector: the hooks vLLM 0.33's `Scheduler` calls on
`self.connector` when it is the `OffloadingConnector` (vllm/v1/core/sched/scheduler.py `schedule`,
`_handle_blocked_waiting_request`, `_update_waiting_for_remote_kv`, `_preempt_request`,
`_free_request`), over `sim.engine.offload.Offloader` (the connector's scheduler side and its tier).

A fresh admission's GPU hit is continued into the host tier (`lookup`); with tokens to load the
request takes blocks for its hit and the loaded tokens, schedules nothing, and waits in `holding`
(vLLM's requests in WAITING_FOR_REMOTE_KVS), served before WAITING (`start_load`). Once its load is
applied it caches the loaded blocks and runs like any waiting request; a full hit recomputes its
last token (`landed`). A request the tier cannot answer yet (a hit chunk still being stored or
loaded) is skipped for the step. Every scheduled step offers its newly computed chunks
(`end_step`); a preemption flushes a request's stores and a finish offers its last chunks.

Adding a connector (P/D disaggregation's decode side waits in `holding` exactly as a load does):
a class with these methods and `holding`, built in `sim.engine.loop.build_scheduler`.
"""

from __future__ import annotations

from kvsim.kvcache.events import KVEvent
from kvsim.kvcache.manager import KVCacheManager
from kvsim.kvcache.offload.tier import HostTier
from kvsim.kvcache.sequence import Sequence
from kvsim.sim.engine.async_loads import AsyncLoads
from kvsim.sim.engine.batch import Batch, Live
from kvsim.sim.engine.config import ConfigError, SimConfig
from kvsim.sim.engine.offload import Offloader


class OffloadConnector:
    """The offloading connector as the scheduler sees it (see the module docstring)."""

    def __init__(self, offloader: Offloader, manager: KVCacheManager, priority: bool, overlapping: bool = False):
        self.offload = offloader
        # batches in flight (async output): each step's poll is taken as it is scheduled (the worker
        # polls when the step is handed to it) and kept until its output lands; its loads start as
        # it is launched, timed to its end (`launched`)
        self._step_polls: dict[int, list[int]] | None = {} if overlapping else None
        self._step_loads: dict[int, list] = {}
        self.m = manager
        self.async_loads = AsyncLoads(manager, priority)  # the held requests and in-flight prefills
        self.holding = self.async_loads.holding
        self._now = 0.0  # when the step being scheduled started

    @classmethod
    def build(cls, cfg: SimConfig, manager: KVCacheManager, bytes_per_block: int,
              seconds_per_block: tuple[float, float]) -> OffloadConnector:
        """The connector with the tier `cfg` asks for (`kv_offloading_size` GiB)."""
        from kvsim.kvcache.offload.size import num_host_chunks

        world = cfg.tensor_parallel
        chunks = num_host_chunks(cfg.kv_offloading_size, bytes_per_block, world, cfg.offload_blocks_per_chunk)
        if cfg.offload_fs:
            if cfg.kv_events:
                raise ConfigError("kv_events: the host tier's KV events with a file tier below it (offload_fs) "
                                  "are not modelled; run without one of the two")
            tier = _tiered(cfg, chunks, bytes_per_block * world * cfg.offload_blocks_per_chunk)
        else:
            tier = HostTier(chunks, cfg.offload_eviction_policy, store_threshold=cfg.offload_store_threshold,
                            kv_events=cfg.kv_events)
        off = Offloader(tier, cfg.block_size, blocks_per_chunk=cfg.offload_blocks_per_chunk,
                        prompt_only=cfg.offload_prompt_only, seconds_per_block=seconds_per_block,
                        bytes_per_block=bytes_per_block * world, prefix_caching=cfg.enable_prefix_caching,
                        ops=manager.op_log if manager.records_ops else None)
        return cls(off, manager, cfg.scheduling == "priority", overlapping=cfg.runs_async)

    # ------------------------------------------------------------- state
    def has_work(self) -> bool:
        """Requests held for a load, or transfers in flight or waiting to start (vLLM's engine keeps
        stepping: `has_requests`, the connector's pending work)."""
        return bool(self.holding) or self.offload.pending()

    def in_flight(self, now: float) -> bool:
        """Whether a transfer is in flight or waits to start at `now`: an empty batch then waits for
        it (the engine spins), it does not stall."""
        return self.offload.busy_until(now) is not None

    def holds_finished(self) -> bool:
        """Whether finished requests' blocks are held (never: a finish frees them, its stores read
        them before they are reused)."""
        return False

    def idle_until(self, now: float) -> float | None:
        """An empty step at `now`: poll and start transfers; the time to schedule again (now if a
        transfer was applied), or None if none is in flight."""
        before = len(self.offload.jobs)
        self.offload.step_ended(now, now)
        if len(self.offload.jobs) < before:
            return now
        return self.offload.busy_until(now)

    def totals(self) -> dict[str, int | float]:
        return self.offload.totals()

    def take_events(self) -> list[KVEvent]:
        """The host tier's KV events since the last take (vLLM's `OffloadingConnector.take_events`),
        which the engine appends to the GPU pool's each step."""
        return self.offload.take_events()

    # ------------------------------------------------------------- the step
    def begin_step(self, now: float) -> None:
        self._now = now
        self.offload.begin_step(now)

    def end_step(self, b: Batch, now: float) -> None:
        """The schedule is chosen: requests done prefilling leave the in-flight set; offer what each
        scheduled sequence will have computed."""
        self.async_loads.schedule_chosen(b)
        tables = self.m.block_tables
        self.offload.end_step([(x.seq, n, tables.get(x.seq.seq_id)) for x, n in zip(b.lives, b.tokens, strict=True)],
                              now)
        if self._step_polls is not None:
            self._step_polls[id(b)] = self.offload.poll(b.start)
            self._step_loads[id(b)] = self.offload.take_planned_loads()

    def launched(self, b: Batch, end: float) -> None:
        """With batches in flight: `b` goes to the device, ending at `end`; its loads start then."""
        loads = self._step_loads.pop(id(b), None)
        if loads:
            self.offload.start_loads(loads, end)

    def step_ended(self, b: Batch, now: float) -> None:
        """Step `b` ended at `now` (a step without a forward: at its start), its output applied:
        the transfers its poll saw complete, and its loads start."""
        if self._step_polls is None:
            self.offload.step_ended(b.start, now)
        else:
            self.offload.step_ended(b.start, now, [], self._step_polls.pop(id(b)))

    # ------------------------------------------------------------- admission
    def lookup(self, seq: Sequence, hit: int) -> int | None:
        """Tokens past the GPU `hit` the tier can load (0: none), or None: ask again next step."""
        return self.offload.lookup(seq, hit)

    def start_load(self, live: Live, hit: int, blocks: list, ext: int, *, watermark: bool, whole: bool) -> bool:
        """Give `live` blocks for its `hit` and `ext` loaded tokens and start the load (vLLM
        `allocate_slots` with external tokens, `update_state_after_alloc`); False: they do not fit."""
        seq = live.seq
        new = self.async_loads.allocate(live, hit, blocks, ext, watermark=watermark, whole=whole)
        if new is None:
            return False
        self.offload.start_load(seq, hit, ext, new)
        self.offload.allocated(self.m.block_tables[seq.seq_id])
        return True

    def landed(self, seq: Sequence) -> int | None:
        """A held request's computed tokens once its load is applied (its loaded blocks cached; a full
        hit recomputes its last token, whose logits are needed), or None: not yet."""
        sid, loaded = seq.seq_id, self.offload.loaded
        applied = sid in loaded
        loaded.discard(sid)
        return self.async_loads.land(seq, applied)

    def admitted(self, live: Live, hit: int, n: int, first: bool) -> int:
        """`live` was admitted with `hit` computed and `n` scheduled; returns the tokens of the hit that
        came from the tier at its (sample's) first admission (the log counts only the GPU hit)."""
        sid = live.seq.seq_id
        loaded = self.async_loads.admitted(live, hit, n)
        off = self.offload
        tier_tokens = 0
        if loaded is not None and first:
            tier_tokens = hit - loaded[0]
            off.hit_tokens += loaded[1]
            off.fs_hit_tokens += off.fs_loaded.get(sid, 0)
        off.fs_loaded.pop(sid, None)
        return tier_tokens

    # ------------------------------------------------------------- leaving
    def preempted(self, live: Live) -> None:
        """`live` is preempted in the step being scheduled: its stores are flushed."""
        self.async_loads.leaving(live.seq.seq_id)
        self.offload.preempted(live.seq, self._now)

    def retiring(self, live: Live, offers: bool, now: float) -> bool:
        """`live` is done at `now`, its blocks not yet freed; `offers`: it finished (or was truncated)
        and its last chunks are offered next step. Returns False: its blocks are freed now."""
        seq = live.seq
        self.async_loads.leaving(seq.seq_id)
        if offers and self.m.holds_blocks(seq.seq_id):
            self.offload.finished(seq)
        return False


def _tiered(cfg: SimConfig, chunks: int, chunk_bytes: int):
    """The host tier over a file tier (vLLM's TieringOffloadingSpec with an `fs` secondary tier): each
    of `offload_fs_threads` read and write threads moves a chunk's bytes (all ranks') at
    `offload_fs_gbps`; `offload_fs_size` GiB holds that many whole chunks."""
    from kvsim.kvcache.offload.fs import FileTier
    from kvsim.kvcache.offload.fs_pool import IOPool
    from kvsim.kvcache.offload.tiered import TieredTier

    seconds = chunk_bytes / (cfg.offload_fs_gbps * 1e9)
    pool = IOPool(cfg.offload_fs_threads, cfg.offload_fs_threads, seconds_per_read=seconds, seconds_per_write=seconds)
    size = cfg.offload_fs_size
    files = FileTier(pool=pool, seconds_per_probe=cfg.offload_fs_probe_s,
                     capacity=None if size is None else int(size * 2**30 // chunk_bytes))
    return TieredTier(chunks, cfg.offload_eviction_policy, files=files, store_threshold=cfg.offload_store_threshold)
