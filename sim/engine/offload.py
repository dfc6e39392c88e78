"""KV offloading to a host tier, the scheduler side: vLLM 0.33's `OffloadingConnectorScheduler`
(vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py) over the CPU tier
(`kvcache.offload.tier.HostTier`, vLLM's `CPUOffloadingManager`).

What it decides, as vLLM does: an admission's GPU prefix hit continues into the tier
(`lookup`: whole chunks, up to every known token, deferred while a hit chunk is still
being stored or loaded); such a request loads asynchronously and waits; each step offers
the full chunks its scheduled requests will have computed (prompt chunks only, by default)
and the finished requests' remaining ones (`end_step`).

Timing (kvsim's model of vLLM's worker, vllm/distributed/kv_transfer/kv_connector/v1/offloading/
worker.py over vllm/v1/kv_offload/cpu/gpu_worker.py): transfers use the host link beside compute,
first in first out per direction, and never lengthen a step. A load planned in step N starts when
step N's forward ends (`start_kv_transfers`, after the forward is launched); stores planned in step
N are held (`prepare_store_kv`) and submitted when step N + 1 starts (`handle_preemptions`, before
its forward), so they start when step N's forward ends. One takes its blocks' bytes over the link
bandwidth (each TP rank moves its own share in parallel). It is seen by the poll at the start of
the first step that begins once it is done, and applied when that step ends, so the schedule after
it sees the result. A step without a forward starts its loads at once. Before a step's forward the
worker waits for the stores vLLM flushes (`jobs_to_flush`: a preempted request's, and a finished
request's once the step hands one of the GPU blocks it reads to a request): they and the stores
ahead of them are done at that step's start, taking no time (`Link.wait`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvsim.kvcache.events import KVEvent
from kvsim.kvcache.offload.fs_pool import FsJob
from kvsim.kvcache.offload.tier import HostTier
from kvsim.kvcache.offload.tiered import TieredTier
from kvsim.kvcache.ops import OpLog
from kvsim.kvcache.sequence import Sequence
from kvsim.sim.engine.host_link import INF, Job, Link


@dataclass(slots=True)
class _Request:
    """vLLM's `RequestOffloadState` for one sequence."""

    seq: Sequence
    keys: list[int] = field(default_factory=list)  # a chunk's key: the hash of its last block
    next_stored: int = 0  # chunks before this one were offered
    blocks: list | None = None  # the request's GPU blocks as last scheduled (held after a free)
    jobs: set[int] = field(default_factory=set)  # its transfers in flight
    finished: bool = False
    num_seen_blocks: int = 0  # of `blocks`, those a step already counted as allocated


class Offloader:
    """The connector's scheduler side for one engine (see the module docstring)."""

    def __init__(self, tier: HostTier | TieredTier, block_size: int, *, blocks_per_chunk: int = 1, prompt_only: bool = True,
                 seconds_per_block: tuple[float, float] = (0.0, 0.0), bytes_per_block: int = 0,
                 prefix_caching: bool = True, ops: OpLog | None = None):
        self.tier = tier
        self.fs = isinstance(tier, TieredTier)  # a file tier below the host tier
        self.ops = ops  # records `store` and `load` ops when given (`record_ops`)
        if self.fs and ops is not None:
            tier.on_done = self._record_file_job
        self._file_ids: dict[int, int] = {}  # a chunk's file, numbered in first-write order, for the ops
        self.bs = block_size
        self.bpc = blocks_per_chunk
        self.tpc = block_size * blocks_per_chunk  # tokens a chunk
        self.prompt_only = prompt_only
        self.bytes_per_block = bytes_per_block  # all ranks' bytes of one GPU block, for the totals
        self.loads, self.stores = Link(seconds_per_block[0]), Link(seconds_per_block[1])
        self.reqs: dict[str, _Request] = {}
        self.jobs: dict[int, Job] = {}
        self._next_job = 0
        self._loading: set[int] | None = set() if prefix_caching else None  # keys of loads in flight
        self._planned_loads: list[Job] = []  # this step's, started when its forward ends
        self._reported: set[int] = set()  # jobs a step's poll saw done, until its output lands
        self._planned_stores: list[Job] = []  # this step's, started when the next step starts
        self._finished: list[str] = []  # finished since the last `end_step`
        self._allocated: set[int] = set()  # GPU blocks the step being scheduled gave to requests
        self._fences: dict[int, set[int]] = {}  # GPU block -> finished requests' stores reading it
        self.loaded: set[str] = set()  # sequences whose load is done (vLLM's finished_recving)
        # totals for the summary
        self.hit_tokens = 0  # loaded at first admissions (as the request log counts GPU hits)
        self.fs_hit_tokens = 0  # of those, read from the file tier first
        self.fs_loaded: dict[str, int] = {}  # a loading request's tokens read from the file tier
        self.stored_blocks = 0
        self.loaded_blocks = 0

    # ------------------------------------------------------------- keys
    def _state(self, seq: Sequence) -> _Request:
        st = self.reqs.get(seq.seq_id)
        if st is None:
            st = self.reqs[seq.seq_id] = _Request(seq)
        return st

    def _update_keys(self, st: _Request) -> None:
        """Keys of the chunks now full of known tokens (vLLM `update_offload_keys`)."""
        seq, bpc = st.seq, self.bpc
        n = seq.num_tokens // self.tpc
        if n > len(st.keys):
            hashes = seq.hashes_upto(n * self.tpc, self.bs)
            st.keys.extend(hashes[(len(st.keys) + 1) * bpc - 1:n * bpc:bpc])

    def _positions(self, first: int, n: int) -> list[int]:
        return [(i + 1) * self.tpc for i in range(first, first + n)]

    # ------------------------------------------------------------- admission
    def lookup(self, seq: Sequence, local: int) -> int | None:
        """Tokens past the `local` (block-aligned) GPU hit that the tier can load, or None: ask
        again next step (vLLM `get_num_new_matched_tokens`, `_lookup_complete_chunks`)."""
        st = self._state(seq)
        st.next_stored = 0  # restarting at token 0: every chunk is offered again
        if st.jobs:
            return None
        self._update_keys(st)
        tpc = self.tpc
        top = min(seq.num_tokens, len(st.keys) * tpc)  # whole chunks, up to the last known token
        if top - local < tpc:
            return 0
        start = local // tpc
        # hits up to the first miss; a chunk whose file probe is out (RETRY) is no hit, but the scan
        # goes on to start the others' probes; a pending one (or a RETRY) defers the request
        hits, defer = self.tier.lookup_chunks(seq.seq_id, st.keys[start:-(-top // tpc)], start, tpc)
        if defer:  # before the size check: vLLM defers on a pending chunk even if the hit is short
            return None
        if hits == 0:
            return 0
        n = min(top, tpc * (start + hits)) - local
        if n < tpc:
            return 0
        if self._loading and any(k in self._loading for k in st.keys[start:-(-(local + n) // tpc)]):
            return None  # another request is loading them: it will be a GPU hit next time
        return n

    def start_load(self, seq: Sequence, local: int, n: int, new_blocks: list) -> None:
        """Plan the load of `seq`'s `n` tokens after its `local` hit into its fresh blocks `new_blocks`
        (vLLM `update_state_after_alloc`): pin the chunks; the request now waits for it."""
        st = self.reqs[seq.seq_id]
        end = -(-(local + n) // self.tpc)
        first_block = -(-local // self.bs)
        first, bpc = first_block // self.bpc, self.bpc
        keys = st.keys[first:end]
        slots = self.tier.prepare_load(seq.seq_id, keys, self._positions(first, len(keys)))
        st.next_stored = end  # the hit and loaded chunks are not offered again
        job = self._job("load", st, keys, len(new_blocks))
        self._planned_loads.append(job)
        if self._loading is not None:
            self._loading.update(keys)
        self.loaded_blocks += len(new_blocks)
        if self.fs:  # tokens of [local, local + n) whose chunk was promoted from the files
            tpc = self.tpc
            self.fs_loaded[seq.seq_id] = sum(min(local + n, (i + 1) * tpc) - max(local, i * tpc)
                                             for i, key in enumerate(keys, first)
                                             if self.tier.from_files(seq.seq_id, key))
        if self.ops is not None:  # block i of the sequence is block i % bpc of its chunk's slot
            self.ops.emit_transfers("load", [(slots[i // bpc - first] * bpc + i % bpc, b.block_id)
                                             for i, b in enumerate(new_blocks, first_block)], seq.seq_id)

    def _job(self, kind: str, st: _Request, keys: list[int], blocks: int) -> Job:
        job = Job(kind, st.seq.seq_id, keys, blocks)
        self.jobs[self._next_job] = job
        st.jobs.add(self._next_job)
        self._next_job += 1
        return job

    # ------------------------------------------------------------- stores
    def allocated(self, blocks: list) -> None:
        """A request admitted in the step being scheduled holds `blocks` (its whole table)."""
        self._allocated.update(b.block_id for b in blocks)

    def end_step(self, scheduled: list[tuple[Sequence, int, list]], now: float) -> None:
        """The end of the schedule at `now`: flush the finished requests' stores whose GPU blocks
        this step gave to a request (a new one's whole table, a running one's new blocks); offer
        what each scheduled (sequence, tokens, blocks) will have computed, in scheduling order,
        then the remaining chunks of the requests finished since (vLLM `_build_connector_meta`,
        `_build_store_jobs`); then commit the finished requests' accesses."""
        allocated = self._allocated
        for seq, _, blocks in scheduled:
            st = self._state(seq)
            if blocks:
                allocated.update(b.block_id for b in blocks[st.num_seen_blocks:])
                st.num_seen_blocks = len(blocks)
        if self._fences:
            for bid in allocated.intersection(self._fences):
                self._flush(self._fences[bid], now)
        for seq, n, blocks in scheduled:
            st = self.reqs[seq.seq_id]
            st.blocks = blocks
            self._update_keys(st)
            self._offer(st, seq.num_computed_tokens + n)
        for sid in self._finished:
            st = self.reqs[sid]
            seq = st.seq
            j = self._offer(st, max(seq.num_prompt_tokens, seq.num_tokens - 1), at_start=True)
            if j is not None:
                self._fence(j)
                if not allocated.isdisjoint(self.jobs[j].block_ids):
                    self._flush((j,), now)
        allocated.clear()
        for sid in self._finished:
            self.tier.request_finished(sid)
            if not self.reqs[sid].jobs:
                del self.reqs[sid]
        self._finished.clear()
        if self.fs:  # the schedule's last tier call: promotions go out, probes are posted
            self.tier.end_step(now)

    def begin_step(self, now: float) -> None:
        """A step starts at `now`: last step's stores start on the link (vLLM `handle_preemptions`
        submits them before the forward); the file tier's jobs and probes done by then are over."""
        for job in self._planned_stores:
            self.stores.start(job, now)
        self._planned_stores = []
        if self.fs:
            self.tier.advance(now)

    def _offer(self, st: _Request, upto: int, at_start: bool = False) -> int | None:
        """Offer `st`'s chunks up to token `upto` to the tier; the store job's id, if any. `at_start`: a
        finished request's, whose blocks this step may reuse, is recorded ahead of the step's ops."""
        seq = st.seq
        n = min(upto, seq.num_tokens)
        if self.prompt_only:
            n = min(n, seq.num_prompt_tokens)
        end = min(n // self.tpc, len(st.blocks or ()) // self.bpc, len(st.keys))
        start = st.next_stored
        if end <= start:
            return None
        keys = st.keys[start:end]
        out = self.tier.prepare_store(seq.seq_id, keys, self._positions(start, end - start))
        if out is None:
            return None  # the tier is full of pinned or pending chunks: offered again next time
        st.next_stored = max(start, end)
        if not out.keys:
            return None
        j = self._next_job
        job = self._job("store", st, list(out.keys), len(out.keys) * self.bpc)
        bpc, blocks = self.bpc, st.blocks
        if out.keys == keys:  # every chunk offered is stored: their blocks in order
            job.block_ids = tuple(b.block_id for b in blocks[start * bpc:end * bpc])
        else:
            chunk = {key: start + i for i, key in enumerate(keys)}
            job.block_ids = tuple(b.block_id for key in out.keys
                                  for b in blocks[chunk[key] * bpc:(chunk[key] + 1) * bpc])
        if self.ops is not None:
            host = [slot * bpc + i for slot in out.slots for i in range(bpc)]
            self.ops.emit_transfers("store", list(zip(job.block_ids, host, strict=True)), seq.seq_id, at_start)
        self._planned_stores.append(job)
        self.stored_blocks += job.blocks
        return j

    def _fence(self, j: int) -> None:
        """A finished request's store `j` reads its freed blocks: reallocating one flushes it."""
        for bid in self.jobs[j].block_ids:
            self._fences.setdefault(bid, set()).add(j)

    def _flush(self, jobs, now: float) -> None:
        """The worker waits for `jobs` before the forward of the step starting `now` (vLLM worker.py
        `handle_preemptions`, `jobs_to_flush`): that step's poll sees them done (`Link.wait`)."""
        for j in jobs:
            job = self.jobs[j]
            if job.done_at == INF:  # planned this step: submitted at once, not with the step's others
                self._planned_stores.remove(job)
            (self.stores if job.kind == "store" else self.loads).wait(job, now)

    def finished(self, seq: Sequence) -> None:
        """`seq` finished (its blocks are freed now); its last chunks are offered next step."""
        st = self.reqs.get(seq.seq_id)
        if st is None:
            self.tier.request_finished(seq.seq_id)
            return
        st.finished = True
        self._update_keys(st)
        self._finished.append(seq.seq_id)
        for j in st.jobs:  # all stores: a request loading is not running
            self._fence(j)

    def preempted(self, seq: Sequence, now: float) -> None:
        """`seq` was preempted at the step starting `now`: its stores are flushed (the worker waits
        for them before the forward, vLLM `jobs_to_flush`), so that step's poll sees them done."""
        st = self.reqs.get(seq.seq_id)
        if st is None:
            return
        st.num_seen_blocks = 0  # readmitted, its whole table is allocated again
        self._flush(st.jobs, now)

    # ------------------------------------------------------------- time
    def take_planned_loads(self) -> list[Job]:
        """The loads the step just scheduled planned, for the caller to start with that step's end
        (`step_ended(..., loads)`): with batches in flight, the next step plans more before it ends."""
        loads, self._planned_loads = self._planned_loads, []
        return loads

    def start_loads(self, loads: list[Job], at: float) -> None:
        """Start `loads` (from `take_planned_loads`) on the link at `at`."""
        for job in loads:
            self.loads.start(job, at)

    def poll(self, start: float) -> list[int]:
        """The transfers a step starting at `start` sees done (the worker's `get_finished`), each
        reported once: with batches in flight a later step may poll before this one's output lands."""
        reported = self._reported
        done = [j for j, job in self.jobs.items() if job.done_at <= start and j not in reported]
        reported.update(done)
        return done

    def step_ended(self, start: float, end: float, loads: list[Job] | None = None,
                   done: list[int] | None = None) -> None:
        """The step that began at `start` ended at `end`: apply the transfers its poll saw (`done`,
        else those done by `start`), then start this step's loads on the link (`loads`, else those
        planned since the last call; its stores wait for the next step's start)."""
        if done is None:
            done = self.poll(start)
        self._reported.difference_update(done)
        for j in done:
            self._complete(j, end)
        if loads is None:
            loads, self._planned_loads = self._planned_loads, []
        self.start_loads(loads, end)

    def _complete(self, j: int, now: float) -> None:
        job = self.jobs.pop(j)
        st = self.reqs[job.sid]
        if job.kind == "store":
            if self.fs:  # the chunks are copied on to the files from `now`
                self.tier.complete_store(job.keys, req=job.sid, now=now)
            else:
                self.tier.complete_store(job.keys)
            if self._fences:
                for bid in job.block_ids:
                    fenced = self._fences.get(bid)
                    if fenced is not None:
                        fenced.discard(j)
                        if not fenced:
                            del self._fences[bid]
        else:
            self.tier.complete_load(job.keys)
            if self._loading is not None:
                self._loading.difference_update(job.keys)
            self.loaded.add(job.sid)
        st.jobs.discard(j)
        if st.finished and not st.jobs and st.seq.seq_id not in self._finished:
            del self.reqs[job.sid]

    def take_events(self) -> list[KVEvent]:
        """The host tier's KV events since the last take (vLLM's `OffloadingConnectorScheduler.take_events`,
        which drains its manager's); none when events are off."""
        return self.tier.take_events()

    def totals(self) -> dict[str, int | float]:
        """The run's offloading figures for its summary."""
        t = self.tier
        return {
            "offload_hit_tokens": self.hit_tokens,
            "host_chunks": t.num_chunks,
            "stored_blocks": self.stored_blocks,
            "loaded_blocks": self.loaded_blocks,
            "stored_bytes": self.stored_blocks * self.bytes_per_block,
            "loaded_bytes": self.loaded_blocks * self.bytes_per_block,
            "offload_evictions": t.num_evictions,
            "offload_store_failures": t.num_alloc_failures,
        } | (self._fs_totals() if self.fs else {})

    def _fs_totals(self) -> dict[str, int]:
        t, files = self.tier, self.tier.files
        return {
            "fs_hit_tokens": self.fs_hit_tokens,
            "fs_files": len(files.files),
            "fs_chunks_written": files.num_written,
            "fs_chunks_read": files.num_read,
            "fs_promotion_failures": t.num_promotion_failures,
            "fs_failed_jobs": files.num_failed_jobs,
        }

    def busy_until(self, now: float) -> float | None:
        """When the engine must step again after an empty step at `now`: `now` if stores wait to
        be started (the next step starts them), else when the next transfer in flight is done;
        None if there is none."""
        if self._planned_stores or self._planned_loads:
            return now
        times = [job.done_at for job in self.jobs.values()]
        if self.fs and (t := self.tier.next_event()) is not None:
            times.append(max(t, now))
        return min(times, default=None)

    def pending(self) -> bool:
        """Whether transfers (or file jobs) are in flight or waiting to start, or finished requests wait
        for their last offer: vLLM's engine keeps stepping, requests or not (vllm/v1/core/sched/
        scheduler.py `has_requests`: finished requests, the connector's `has_pending_push_work`)."""
        return bool(self.jobs or self._finished or self._planned_loads or self._planned_stores) \
            or (self.fs and self.tier.has_pending_work())

    def _record_file_job(self, job: FsJob, keys: tuple[int, ...]) -> None:
        """Record a finished file job's `file_write` (host block -> file block) or `file_read` ops, a block
        each, for the `keys` that made it: a cascade's host slots stay pinned and a promotion's slots
        pending until this moment, so the recorded order is the order the data moved."""
        bpc, ids, pairs = self.bpc, self._file_ids, []
        slot_of = dict(zip(job.keys, job.slots, strict=True))
        for key in keys:
            f = ids.setdefault(key, len(ids))
            for i in range(bpc):
                host, file = slot_of[key] * bpc + i, f * bpc + i
                pairs.append((file, host) if job.promotion else (host, file))
        self.ops.emit_transfers("file_read" if job.promotion else "file_write", pairs, job.req)
