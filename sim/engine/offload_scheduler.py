"""The scheduler with KV offloading on: vLLM 0.33's `Scheduler` waiting loop with its KV connector
(vllm/v1/core/sched/scheduler.py `schedule`, `_handle_blocked_waiting_request`,
`_update_waiting_for_remote_kv`), over `sim.engine.offload.Offloader`.

A fresh admission's GPU hit is continued into the host tier; with tokens to load the request
takes blocks for its hit and the loaded tokens, schedules nothing, and waits in a queue of
requests holding blocks, served before WAITING. Once its load is applied it caches the loaded
blocks and runs like any waiting request (a full hit recomputes its last token). A request the
connector cannot answer yet (a hit chunk still being stored or loaded) is skipped for the step:
the ones behind it may go first. Every scheduled step offers its newly computed chunks.
Speed shortcuts are off (every running sequence is visited each step).
"""

from __future__ import annotations

from kvcache.offload.tier import HostTier
from sim.engine.batch import Batch, Live
from sim.engine.config import SimConfig
from sim.engine.metrics import FINISHED, TRUNCATED
from sim.engine.offload import Offloader
from sim.engine.scheduler import Scheduler
from sim.engine.wait_queue import WaitQueue


class OffloadScheduler(Scheduler):
    """`Scheduler` plus the offloading connector's scheduler side (see the module docstring)."""

    has_shortcuts = False

    def __init__(self, cfg: SimConfig, manager, log, offloader: Offloader):
        super().__init__(cfg, manager, log)
        self.offload = offloader
        self.holding = WaitQueue(self.priority)  # requests holding blocks for a load (vLLM kv_holding_waiting)
        self._landed: set[str] = set()  # of those, the ones whose load is applied
        self._loads: dict[str, tuple[int, int]] = {}  # a loading request's GPU hit and loaded tokens, for its log
        self._inflight: dict[str, Live] = {}  # requests still prefilling (vLLM _inflight_prefills)
        self._now = 0.0

    @classmethod
    def build(cls, cfg: SimConfig, manager, log, bytes_per_block: int, seconds_per_block: tuple[float, float]):
        """The scheduler with the tier `cfg` asks for (`kv_offloading_size` GiB)."""
        from kvcache.offload.size import num_host_chunks

        world = cfg.tensor_parallel
        chunks = num_host_chunks(cfg.kv_offloading_size, bytes_per_block, world, cfg.offload_blocks_per_chunk)
        if cfg.offload_fs:
            tier = _tiered(cfg, chunks, bytes_per_block * world * cfg.offload_blocks_per_chunk)
        else:
            tier = HostTier(chunks, cfg.offload_eviction_policy, store_threshold=cfg.offload_store_threshold)
        off = Offloader(tier, cfg.block_size, blocks_per_chunk=cfg.offload_blocks_per_chunk,
                        prompt_only=cfg.offload_prompt_only, seconds_per_block=seconds_per_block,
                        bytes_per_block=bytes_per_block * world, prefix_caching=cfg.enable_prefix_caching,
                        ops=manager.ops if manager.records_ops else None)
        return cls(cfg, manager, log, off)

    def has_work(self) -> bool:
        return bool(self.holding) or super().has_work() or self.offload.pending()

    def schedule(self, now: float) -> Batch:
        self._now = now
        self.offload.begin_step(now)
        b = super().schedule(now)
        blocks = self.m.req_blocks
        self.offload.end_step([(x.seq, n, blocks.get(x.seq.seq_id)) for x, n in zip(b.lives, b.tokens, strict=True)],
                              now)
        return b

    def complete(self, b: Batch, now: float) -> None:
        super().complete(b, now)
        for sid, live in list(self._inflight.items()):
            seq = live.seq
            if sid not in self._loads and seq.num_computed_tokens >= seq.num_tokens:
                del self._inflight[sid]
        self.offload.step_ended(self._now, now)

    def idle_until(self, now: float) -> float | None:
        """An empty step at `now`: poll and start transfers; the time to schedule again (now if a
        transfer was applied), or None if none is in flight."""
        before = len(self.offload.jobs)
        self.offload.step_ended(now, now)
        if len(self.offload.jobs) < before:
            return now
        return self.offload.busy_until(now)

    # ------------------------------------------------------------- admission
    def _eligible(self) -> int:
        # NOTE: vLLM counts the requests holding blocks for a load as waiting (get_request_counts)
        return len(self.running) + len(self.waiting) + len(self.holding)

    def _admit_waiting(self, b: Batch, budget: int, now: float) -> None:
        m, running, off = self.m, self.running, self.offload
        skipped_holding: list[Live] = []
        skipped_waiting: list[Live] = []
        while budget > 0:
            queue = self.holding if self.holding else self.waiting
            if not queue:
                break
            live = queue.peek()
            width = live.req.n if live.seq is None else 1
            if len(running) + width > self.max_active:
                break
            held = bool(running)
            seq = live.seq if live.seq is not None else self._materialise(live)
            sid = seq.seq_id
            if queue is self.holding:
                if sid not in self._landed:
                    if sid not in off.loaded:
                        skipped_holding.append(queue.pop())
                        self._skipped(live)
                        continue
                    off.loaded.discard(sid)
                    self._landed.add(sid)
                    m.cache_blocks(seq, seq.num_computed_tokens)
                    if seq.num_computed_tokens == seq.num_tokens:
                        seq.num_computed_tokens -= 1  # its logits are needed: recompute the last token
                hit, blocks = seq.num_computed_tokens, None
            else:
                blocks, hit = m.get_computed_blocks(seq)
                ext = off.lookup(seq, hit)
                if ext is None:
                    skipped_waiting.append(queue.pop())
                    self._skipped(live)
                    continue
                if ext:
                    reserved = sum(m.blocks_to_finish(x.seq) for x in self._inflight.values())
                    new = m.allocate_for_load(seq, hit, blocks, ext, reserved=reserved, watermark=held,
                                              whole=self.whole_fit)
                    if new is None:
                        break
                    off.start_load(seq, hit, ext, new)
                    off.allocated(m.req_blocks[sid])
                    seq.num_computed_tokens = hit + ext
                    self._loads[sid] = (hit, ext)
                    self._inflight[sid] = live
                    queue.pop()
                    skipped_holding.append(live)  # it holds blocks now
                    self._skipped(live)
                    continue
            if self.prefill_held and hit < seq.num_tokens - 1:  # the cadence holds prompts back (loads still start)
                break
            n = self._admission_tokens(seq, hit, budget, held)
            if not n:
                break
            if blocks is None:  # its blocks are held: `hit` tokens are computed already
                ok = m.allocate_slots(seq, n, 0, None, self.lookahead, watermark=held,
                                      full_sequence_must_fit=self.whole_fit)
            else:
                ok = m.allocate_slots(seq, n, hit, blocks, self.lookahead, watermark=held,
                                      full_sequence_must_fit=self.whole_fit)
            if ok is None:
                # NOTE: requests holding blocks for a load (popped into skipped_holding meanwhile)
                # hold them as running ones do: vLLM waits for them, nothing "never fits"
                if held or skipped_holding or len(self.holding) > (queue is self.holding):
                    break
                queue.pop()
                self._retire_never_fits(live, now)
                continue
            queue.pop()
            self._landed.discard(sid)
            loaded = self._loads.pop(sid, None)
            log, row = self.log, live.row
            first = not live.admitted  # its (sample's) first admission
            self._admit(b, live, hit, n, now)
            if loaded is not None and first:  # the log counts the GPU hit; the rest came from the tier
                b.admitted_hit_tokens -= hit - loaded[0]
                log.hit_tokens[row] -= hit - loaded[0]
                self.offload.hit_tokens += loaded[1]
                self.offload.fs_hit_tokens += self.offload.fs_loaded.get(sid, 0)
            self.offload.fs_loaded.pop(sid, None)
            if hit + n < seq.num_tokens:
                self._inflight[sid] = live
            else:
                self._inflight.pop(sid, None)
            budget -= n
        for queue, lives in ((self.holding, skipped_holding), (self.waiting, skipped_waiting)):
            for live in reversed(lives):  # back at the front, in their order (vLLM prepend_requests)
                queue.push(live, front=True)

    def _has_waiting(self) -> bool:
        return bool(self.waiting or self.holding)

    # ------------------------------------------------------------- leaving
    def _make_room(self, live: Live, n: int, b: Batch, now: float) -> bool:
        if self.holding and len(self.running) == 1 and not b.num_seqs:
            # NOTE: not alone: requests holding blocks for a load may free them, so it preempts
            # itself as vLLM does rather than "never fitting" (sim.engine.scheduler._make_room)
            self.running.pop()
            self.fast.preempted(live, self._k)
            self._preempt(live, b)
            return False
        return super()._make_room(live, n, b, now)

    def _preempt(self, live: Live, b: Batch) -> None:
        self._inflight.pop(live.seq.seq_id, None)
        self.offload.preempted(live.seq, self._now)
        super()._preempt(live, b)

    def _retire(self, live: Live, status: int, reason: str, now: float) -> None:
        seq = live.seq
        if seq is not None:
            self._inflight.pop(seq.seq_id, None)
            if status in (FINISHED, TRUNCATED) and seq.seq_id in self.m.req_blocks:
                self.offload.finished(seq)
        super()._retire(live, status, reason, now)


def _tiered(cfg: SimConfig, chunks: int, chunk_bytes: int):
    """The host tier over a file tier (vLLM's TieringOffloadingSpec with an `fs` secondary tier): each
    of `offload_fs_threads` read and write threads moves a chunk's bytes (all ranks') at
    `offload_fs_gbps`; `offload_fs_size` GiB holds that many whole chunks."""
    from kvcache.offload.fs import FileTier
    from kvcache.offload.fs_pool import IOPool
    from kvcache.offload.tiered import TieredTier

    seconds = chunk_bytes / (cfg.offload_fs_gbps * 1e9)
    pool = IOPool(cfg.offload_fs_threads, cfg.offload_fs_threads, seconds_per_read=seconds, seconds_per_write=seconds)
    size = cfg.offload_fs_size
    files = FileTier(pool=pool, seconds_per_probe=cfg.offload_fs_probe_s,
                     capacity=None if size is None else int(size * 2**30 // chunk_bytes))
    return TieredTier(chunks, cfg.offload_eviction_policy, files=files, store_threshold=cfg.offload_store_threshold)
