"""vLLM 0.33.0's Scheduler with native KV offloading (`--kv-offloading-size`: the
OffloadingConnector over its CPU tier) on kvsim's step grid, for diffing against kvsim's
engine with `SimConfig.kv_offloading_size` (`sim.engine.offload`).

The connector's scheduler side is vLLM's own; its worker is `FakeWorker`, which takes the
order of its copies from vLLM's worker and times them on kvsim's `Link`. On kvsim's step grid:

- step g is scheduled at g * S; its poll sees the transfers done by g * S, and its output
  reports them (`completed_jobs`, and `finished_recving` for the loads' requests);
- an empty step takes its slot; if it applied no transfer and left no store waiting to be
  submitted, the next step is the first slot whose start is at or after the next transfer's end
  or the next arrival (sim.engine.loop, `Scheduler.idle_until` through its connector).

vLLM keeps the requests finished since the last step in a set; the driver gives the Scheduler
an insertion-ordered one each step, so their last offers and policy commits follow the order
they finished in, as kvsim's (a set's order follows PYTHONHASHSEED).

The tier has kvsim's chunk count: vLLM is given the GiB that buy exactly that many
chunks of its one-layer model (`Offloading.vllm_size_gib`), and the built manager is checked.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvsim.kvcache.offload.size import PAGE_BYTES
from kvsim.sim.conform.vllm_scheduler import (
    Request,
    _build_scheduler,
    _EventSink,
    _SchedRun,
    prefixes,
    prepare,
)
from kvsim.sim.conform.vllm_setup import stand_in_spec
from kvsim.sim.engine.host_link import Job, Link
from kvsim.sim.engine.loop import grid_index


@dataclass(frozen=True)
class Offloading:
    """kvsim's host tier and link, as vLLM's connector and the fake worker must see them."""

    num_chunks: int
    eviction_policy: str = "lru"
    store_threshold: int = 0
    blocks_per_chunk: int = 1
    prompt_only: bool = True
    seconds_per_block: tuple[float, float] = (0.0, 0.0)  # load, store (kvsim's cost.op_cost_s)

    def vllm_size_gib(self, bytes_per_block: int) -> float:
        """GiB that give `num_chunks` chunks by vLLM's formula (vllm/v1/kv_offload/cpu/spec.py:
        int(GiB * 2^30) // round_up(bytes_per_block * world_size * blocks_per_chunk, 4096))."""
        aligned = -(-bytes_per_block * self.blocks_per_chunk // PAGE_BYTES) * PAGE_BYTES
        return self.num_chunks * aligned / (1 << 30)  # exact: a multiple of 4096 over a power of two

    def prepare(self, recs: dict, block_size: int, num_gpu_blocks: int) -> tuple[float, dict[str, Any]]:
        """Check the tier, give each record its `offload_hit_tokens`, and return what vLLM is built with
        (`_build_scheduler`'s `offloading`: GiB and the connector's extra config)."""
        if self.num_chunks < 1:
            raise ValueError(f"the host tier holds {self.num_chunks} chunks; vLLM needs at least 1")
        for rec in recs.values():
            rec["offload_hit_tokens"] = 0
        page = stand_in_spec(block_size).page_size_bytes
        return self.vllm_size_gib(page), self.extra_config()

    def worker(self, sched) -> FakeWorker:
        """The fake worker for vLLM's scheduler `sched`, once its connector is checked to be this tier."""
        _check_connector(sched, self)
        return FakeWorker(self.seconds_per_block)

    def extra_config(self) -> dict[str, Any]:
        """The `kv_connector_extra_config` entries for kvsim's offloading options."""
        return {"eviction_policy": self.eviction_policy, "store_threshold": self.store_threshold,
                "blocks_per_chunk": self.blocks_per_chunk, "offload_prompt_only": self.prompt_only}


class FakeWorker:
    """vLLM 0.33's connector worker (`OffloadingConnectorWorker`, vllm/distributed/kv_transfer/
    kv_connector/v1/offloading/worker.py) over its CPU worker (vllm/v1/kv_offload/cpu/gpu_worker.py),
    with copies timed on kvsim's `Link`: a copy lasts its GPU blocks * seconds per block. Each step g
    (starting at g * S) runs, as vLLM's model runner calls them (vllm/v1/worker/gpu_model_runner.py
    `execute_model`, kv_connector_model_runner_mixin.py `_get_kv_connector_output`):

    - `handle_preemptions`, before the forward: the step's store jobs in `jobs_to_flush` join the
      held ones, and all of those are submitted at g * S; then `wait(jobs_to_flush)`;
    - `start_kv_transfers`, after the forward is launched: the step's loads are submitted, and
      start when the forward ends ((g + 1) * S; at g * S when the step has none);
    - `wait_for_save` -> `prepare_store_kv`: the step's other store jobs are held for the next step;
    - `get_finished`: the copies done by g * S are reported (`completed_jobs`, and
      `finished_recving` for a load's request).

    `CPUOffloadingWorker.submit_store` / `submit_load` put a copy on its direction's
    `SingleDirectionOffloadingHandler`, whose stream waits for the compute stream and for the
    previous copy's end event (first in first out); `wait` synchronizes on a job's end event, so
    the jobs ahead of it end first. Waiting takes no time here (kvsim's steps are never
    lengthened): the job waited for and those ahead are done at g * S, those behind start then.
    Sync loads (`sync_load_budget_bytes`, off by default) are not modelled."""

    def __init__(self, seconds_per_block: tuple[float, float]):
        self.loads, self.stores = Link(seconds_per_block[0]), Link(seconds_per_block[1])
        self.jobs: dict[int, Job] = {}  # vLLM job id -> the copy, until reported
        self._held_stores: list[Job] = []  # `_unsubmitted_store_jobs`
        self._step_loads: list[Job] = []  # submitted after this step's forward

    def poll(self, meta, start: float) -> tuple[dict[int, int], set[str]]:
        """Step `meta` at `start` up to its output: its flushes, its jobs, and the jobs done by
        `start` (completed_jobs) with the requests whose loads they are (finished_recving)."""
        flush = meta.jobs_to_flush or set()
        stores = [(jid, t) for jid, t in meta.store_jobs.items() if jid not in flush]
        self._held_stores += [self._job(jid, "store", t.req_id, t.src_spec) for jid, t in meta.store_jobs.items()
                              if jid in flush]
        for job in self._held_stores:  # handle_preemptions
            self.stores.start(job, start)
        self._held_stores = []
        for jid in flush:
            job = self.jobs.get(jid)  # None once reported (no end event left to wait on)
            if job is not None:
                (self.stores if job.kind == "store" else self.loads).wait(job, start)
        for jid, t in meta.load_jobs.items():  # start_kv_transfers
            if t.sync:
                raise NotImplementedError("sync KV loads are not modelled (sync_load_budget_bytes)")
            self._step_loads.append(self._job(jid, "load", t.req_id, t.dst_spec))
        self._held_stores = [self._job(jid, "store", t.req_id, t.src_spec) for jid, t in stores]  # prepare_store_kv
        # get_finished: the store handler's copies, then the loads', each in submission order
        done = [jid for kind in ("store", "load") for jid, job in self.jobs.items()
                if job.kind == kind and job.done_at <= start]
        recving = {self.jobs[jid].sid for jid in done if self.jobs[jid].kind == "load"}
        for jid in done:
            del self.jobs[jid]
        return dict.fromkeys(done, 1), recving

    def _job(self, jid: int, kind: str, req_id: str, gpu_spec) -> Job:
        job = self.jobs[jid] = Job(kind, req_id, [], len(gpu_spec.block_ids))
        return job

    def step_ended(self, end: float) -> None:
        """The step's forward ended at `end`: its loads start."""
        for job in self._step_loads:
            self.loads.start(job, end)
        self._step_loads = []

    def busy_until(self, now: float) -> float | None:
        """After an empty step at `now`: `now` if stores are held (the next step submits them),
        else when the next copy ends; None if none is in flight."""
        if self._held_stores or self._step_loads:
            return now
        return min((job.done_at for job in self.jobs.values()), default=None)


def run_offload_scheduler(
    requests: Iterable[Request], *, offloading: Offloading, block_size: int, num_gpu_blocks: int,
    max_num_batched_tokens: int, max_num_seqs: int, enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = True, long_prefill_token_threshold: int = 0,
    watermark: float = 0.0, step_time: float = 1.0, scheduling: str = "fcfs", max_model_len: int | None = None,
    scheduler_extra: dict[str, Any] | None = None, async_scheduling: bool | None = False, kv_events: list | None = None,
) -> list[dict]:
    """vLLM's Scheduler (AsyncScheduler with `async_scheduling`, behind EngineCore's batch queue) with
    the OffloadingConnector and the fake worker, one step per `step_time`; records in workload order,
    as `sim.conform.vllm_scheduler.run_scheduler`'s plus `offload_hit_tokens` (vLLM's external hit
    at first admission; kvsim logs only the total). `kv_events`: as `run_scheduler`'s,
    with `--kv-events-config` on, so the batches also carry the connector's events (the CPU tier's,
    `OffloadingConnectorScheduler.take_events`, appended by `Scheduler.update_from_output`)."""
    reqs, tokens, recs, max_model_len = prepare(
        requests, step_time=step_time, scheduling=scheduling, max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs, enable_chunked_prefill=enable_chunked_prefill,
        long_prefill_token_threshold=long_prefill_token_threshold, max_model_len=max_model_len)
    built_with = offloading.prepare(recs, block_size, num_gpu_blocks)
    with tempfile.TemporaryDirectory(prefix="kvsim-vllm-") as tmp:
        sched, hasher, queue_size = _build_scheduler(
            tmp, block_size=block_size, num_gpu_blocks=num_gpu_blocks,
            max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs, enable_chunked_prefill=enable_chunked_prefill,
            enable_prefix_caching=enable_prefix_caching,
            long_prefill_token_threshold=long_prefill_token_threshold, watermark=watermark,
            scheduling=scheduling, offloading=built_with,
            scheduler_extra=scheduler_extra, async_scheduling=async_scheduling, kv_events=kv_events is not None)
        run = _OffloadRun(sched, reqs, tokens, hasher, recs, step_time)
        worker = run.worker = offloading.worker(sched)
        if kv_events is not None:
            if not enable_prefix_caching:
                raise ValueError("KV events are compared with prefix caching on")
            sched.kv_event_publisher = _EventSink(run, prefixes(tokens, hasher, block_size), kv_events)
        if queue_size > 1:  # async
            if not sched.defer_block_free:
                raise RuntimeError("expected vLLM to defer block frees with async scheduling and a KV connector")
            run.run_async(queue_size, num_gpu_blocks, block_size)  # _SchedRun's, handing each step to the worker
        else:
            run.run(worker, num_gpu_blocks, block_size)
    return [recs[r.id] for r in reqs]


def _check_connector(sched, off: Offloading) -> None:
    """vLLM built the tier kvsim has: its chunk count and options."""
    conn = sched.connector.connector_scheduler
    got = (conn.manager._num_chunks, conn.config.blocks_per_chunk, conn.config.offload_prompt_only)
    want = (off.num_chunks, off.blocks_per_chunk, off.prompt_only)
    if got != want:
        raise RuntimeError(f"vLLM's offloading tier has (chunks, blocks per chunk, prompt only) {got}, "
                           f"kvsim's {want}")


class _OrderedIds(dict):
    """A set of request ids that iterates in insertion order (the `add`, `in` and iteration
    of vLLM's `Scheduler.finished_req_ids`)."""

    def add(self, rid: str) -> None:
        self[rid] = None

    def discard(self, rid: str) -> None:
        self.pop(rid, None)


class _OffloadRun(_SchedRun):
    """The sync loop of `_SchedRun.run_sync` with the fake worker and kvsim's empty-step grid rule."""

    def run(self, worker: FakeWorker, num_gpu_blocks: int, block_size: int) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
            OffloadingWorkerMetadata,
        )
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        sched, S = self.sched, self.step_time
        step = 0
        while self.pending() or sched.has_requests():  # vLLM EngineCore: transfers in flight keep it stepping
            if not sched.has_requests():
                step = max(step, self.next_arrival_step())
            self.add_arrivals(step)
            out = sched.schedule()
            sched.finished_req_ids = _OrderedIds()  # see the module docstring
            self._record_external(out)
            start = step * S
            completed, recving = worker.poll(out.kv_connector_metadata, start)
            kv_out = KVConnectorOutput(finished_recving=recving or None,
                                       kv_connector_worker_meta=OffloadingWorkerMetadata(completed_jobs=completed))
            ids = self.sync_step(out, step, ModelRunnerOutput, kv_out)
            if ids or out.preempted_req_ids:
                step += 1
                worker.step_ended(step * S)
                continue
            worker.step_ended(start)  # no forward: the worker starts its transfers at once
            until = start if completed else worker.busy_until(start)
            if until is None:
                if sched.has_requests():  # kvsim stops here too ("scheduler made no progress")
                    raise self.stalled(1, step, num_gpu_blocks, block_size)
                if not self.pending():
                    break
                until = self.reqs[self.order[self.nxt]].arrival  # idle until the next arrival
            if until <= start:
                step += 1
                continue
            if self.pending():
                until = min(until, self.reqs[self.order[self.nxt]].arrival)
            step = max(grid_index(until, S), step + 1)

    worker: FakeWorker | None = None

    def _in_flight(self, now: float) -> bool:
        return self.worker is not None and self.worker.busy_until(now) is not None

    def _handed(self, out, start: float):
        """Step `out` is handed to the fake worker at `start` (its flushes, jobs and poll): the
        connector output its runner returns, and whether a transfer was reported done."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
            OffloadingWorkerMetadata,
        )
        from vllm.v1.outputs import KVConnectorOutput

        if self.worker is None:  # (sim.conform.vllm_timed's runs without offloading)
            return super()._handed(out, start)
        self.sched.finished_req_ids = _OrderedIds()  # see the module docstring
        self._record_external(out)
        completed, recving = self.worker.poll(out.kv_connector_metadata, start)
        return KVConnectorOutput(finished_recving=recving or None,
                                 kv_connector_worker_meta=OffloadingWorkerMetadata(completed_jobs=completed)), \
            bool(completed)

    def _ended(self, end: float) -> None:
        if self.worker is not None:
            self.worker.step_ended(end)

    def _record_external(self, out) -> None:
        """vLLM's tier hit at the first admission of each request scheduled for the first time."""
        for rid in out.num_scheduled_tokens:
            rec = self.recs[rid]
            if rec["first_scheduled_step"] is None:  # before sync_step records it
                stats = self.live[rid][0].prefill_stats
                rec["offload_hit_tokens"] = stats.num_external_cached_tokens if stats is not None else 0
