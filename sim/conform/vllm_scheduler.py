"""vLLM 0.33.0's own Scheduler on kvsim's step grid, for diffing against `kvsim run --step-time`.

`run_scheduler` drives the synchronous `Scheduler` (or, with async_scheduling,
the `AsyncScheduler` behind EngineCore's two-deep batch queue) with a fake
model runner, and records per request the steps it was first scheduled,
sampled its first token and finished. Shared set-up is in `sim.conform.vllm_setup`.
"""

from __future__ import annotations

import tempfile
from collections import deque
from collections.abc import Iterable
from typing import Any

from kvsim.sim.conform.vllm_setup import (
    STALL_STEPS,
    PrefixName,
    Request,
    block_hasher,
    check_ids,
    kv_cache_config,
    prefix_names,
    require_vllm,
    stand_in_config,
    token_ids,
    vllm_request,
)
from kvsim.sim.engine import loop
from kvsim.sim.engine.loop import grid_index  # the engine's own grid, so both sides queue alike


def _build_scheduler(tmp: str, *, block_size: int, num_gpu_blocks: int, max_model_len: int,
                     max_num_batched_tokens: int, max_num_seqs: int, enable_chunked_prefill: bool,
                     enable_prefix_caching: bool, long_prefill_token_threshold: int,
                     watermark: float, scheduling: str, async_scheduling: bool | None = False,
                     offloading: tuple[float, dict[str, Any]] | None = None, sliding_window: int | None = None,
                     scheduler_extra: dict[str, Any] | None = None, prefix_cache_retention_interval: int | None = 0,
                     layers: Any = None, mamba_checkpoints: bool = False, kv_events: bool = False,
                     kv_transfer: dict[str, Any] | None = None):
    """vLLM's Scheduler (AsyncScheduler if `async_scheduling`; None: as `VllmConfig` resolves it for
    `vllm serve`, which must be async, kvsim's reading of that default) for a one-layer Llama in `tmp`;
    `offloading` (GiB, extra config): with `--kv-offloading-size` and its OffloadingConnector;
    `sliding_window`: the layer attends to that many tokens (vLLM's SlidingWindowSpec); `layers`:
    instead, a model's layers mixing kinds, in vLLM's hybrid KV-cache groups (`vllm_setup.layer_specs`);
    `scheduler_extra`: more SchedulerConfig fields (max_num_active_seqs, ...); `mamba_checkpoints`:
    the model's Mamba-state layers export prefill checkpoints (`vllm_setup.mamba_spec`); `kv_events`:
    its block pool queues KV events; `kv_transfer`: with the NixlConnector and that extra config
    (both `vllm_setup.stand_in_config`).

    Returns (scheduler, block hasher, vllm_config.max_concurrent_batches: 2 with async scheduling).
    """
    from vllm.config import SchedulerConfig
    from vllm.v1.core.kv_cache_utils import (
        resolve_cache_hit_alignment_tokens,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    scheduler_config = SchedulerConfig(
        max_model_len=max_model_len, is_encoder_decoder=False,
        max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
        enable_chunked_prefill=enable_chunked_prefill,
        long_prefill_token_threshold=long_prefill_token_threshold, watermark=watermark,
        policy=scheduling, async_scheduling=async_scheduling, **(scheduler_extra or {}),
    )
    offload_kw = {} if offloading is None else {"kv_offloading_size": offloading[0],
                                                 "kv_offloading_backend": "native"}
    vllm_config = stand_in_config(tmp, max_model_len=max_model_len, scheduler=scheduler_config, cache={
        "block_size": block_size, "enable_prefix_caching": enable_prefix_caching,
        "prefix_cache_retention_interval": prefix_cache_retention_interval, **offload_kw}, kv_events=kv_events,
        kv_transfer=kv_transfer)
    if offloading is not None:  # the connector reads these when the Scheduler builds it
        vllm_config.kv_transfer_config.kv_connector_extra_config.update(offloading[1])
    # What EngineCore does once it has sized the KV cache (here: given, not profiled).
    kv_config = kv_cache_config(vllm_config, num_gpu_blocks, sliding_window, layers, mamba_checkpoints)
    vllm_config.cache_config.num_gpu_blocks = num_gpu_blocks
    sched_bs, hash_bs = resolve_kv_cache_block_sizes(kv_config, vllm_config)
    kv_config.hash_block_size = hash_bs
    kv_config.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(
        kv_config, vllm_config, sched_bs, hash_bs)
    resolved = vllm_config.scheduler_config.async_scheduling  # VllmConfig.__post_init__ decided a None
    if async_scheduling is None and resolved is not True:
        raise RuntimeError(f"vLLM resolved async_scheduling=None to {resolved!r} here, where kvsim resolves it "
                           "to async (SimConfig.runs_async)")
    # EngineCore picks the class the same way (vllm/v1/engine/core.py).
    scheduler_cls = AsyncScheduler if resolved else Scheduler
    scheduler = scheduler_cls(
        vllm_config=vllm_config, kv_cache_config=kv_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=sched_bs, hash_block_size=hash_bs, log_stats=False,
    )
    # EngineCore hashes blocks for prefix caching or for a KV connector (vllm/v1/engine/core.py)
    hasher = block_hasher(hash_bs, vllm_config.cache_config.prefix_caching_hash_algo) \
        if enable_prefix_caching or offloading is not None or kv_transfer is not None else None
    queue_size = vllm_config.max_concurrent_batches
    if queue_size != (2 if resolved else 1):  # the drivers' batch queues: one in flight, or two
        raise RuntimeError(f"expected vLLM's batch queue of {2 if resolved else 1}, got {queue_size}")
    return scheduler, hasher, queue_size


def run_scheduler(
    requests: Iterable[Request], *, block_size: int, num_gpu_blocks: int,
    max_num_batched_tokens: int, max_num_seqs: int, enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = True, long_prefill_token_threshold: int = 0,
    watermark: float = 0.0, step_time: float = 1.0, scheduling: str = "fcfs",
    async_scheduling: bool | None = False, sliding_window: int | None = None, max_model_len: int | None = None,
    scheduler_extra: dict[str, Any] | None = None, prefix_cache_retention_interval: int | None = 0,
    layers: Any = None, mamba_checkpoints: bool = False, kv_events: list | None = None,
) -> list[dict]:
    """Run vLLM's Scheduler with a fake runner, one step per `step_time`; records in workload order.
    `scheduler_extra`: more SchedulerConfig fields (vLLM 0.31+'s max_num_active_seqs, ...).
    `kv_events`: a list that gets each published KV-event batch as (step, events) (async: the step the
    batch whose output is applied was scheduled for, a slot, or the start of one without tokens), every
    event a dict in vLLM's field names, each block hash replaced by the tokens of the prefix it
    ends (`_EventSink`), so that they compare with kvsim's, whose hash function differs.

    Each record: id, first_scheduled_step, first_token_step, finish_step, preemptions,
    hit_tokens (local prefix-cache hit at first admission). num_gpu_blocks counts block 0.
    Steps are slots of the grid: step k executes during [k * step_time, (k+1) * step_time).
    first_scheduled_step is the step of the first batch that gives the request tokens,
    first_token_step the step of the batch that samples its first token (a stale output
    that vLLM still delivers counts), finish_step that of the batch that samples its last.

    Sync (`async_scheduling=False`): step k is scheduled at k * step_time, sees arrivals
    <= k * step_time and its output is applied before step k+1 is scheduled; a step that
    schedules nothing still takes its slot.

    Async (`async_scheduling=True`, or None, which `VllmConfig` resolves to async as `vllm serve`
    0.33 does): vLLM's AsyncScheduler, driven as EngineCore's
    `step_with_batch_queue` drives it with a batch queue of vllm_config.max_concurrent_batches
    (2). Each engine iteration at clock time T adds the arrivals <= T; if the scheduler has
    requests it schedules a batch and queues it, and if the queue is not full and (the batch
    has tokens or the scheduler has requests) the iteration ends; otherwise the oldest batch
    is popped, the clock waits for its end, and its output is applied (`update_from_output`).
    A batch with tokens takes the next free slot b = max(last slot + 1, T / step_time) and
    ends at (b+1) * step_time; a batch without tokens takes no slot and ends at once (the
    runner skips it). So an idle engine woken by an arrival schedules slot b at b * step_time
    and slot b+1 at once as well (both see arrivals <= b * step_time); in a busy period slot
    b+1 is scheduled at b * step_time (when slot b-1 ends and b starts), one step earlier
    than in sync, so an arrival in ((b-1) * step_time, b * step_time] first gets slot b+1,
    not b. When the engine schedules an empty batch with no batch with tokens in flight it
    spins; the clock then moves one step per empty schedule, as idle sync steps do. The fake
    runner samples, when the batch is scheduled, the request's next token (after its output
    placeholders) for every request whose chunk is not a partial prefill.
    """
    reqs, tokens, recs, max_model_len = prepare(
        requests, step_time=step_time, scheduling=scheduling, max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs, enable_chunked_prefill=enable_chunked_prefill,
        long_prefill_token_threshold=long_prefill_token_threshold, max_model_len=max_model_len)
    with tempfile.TemporaryDirectory(prefix="kvsim-vllm-") as tmp:
        sched, hasher, queue_size = _build_scheduler(
            tmp, block_size=block_size, num_gpu_blocks=num_gpu_blocks,
            max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs, enable_chunked_prefill=enable_chunked_prefill,
            enable_prefix_caching=enable_prefix_caching,
            long_prefill_token_threshold=long_prefill_token_threshold, watermark=watermark,
            scheduling=scheduling, async_scheduling=async_scheduling, sliding_window=sliding_window,
            prefix_cache_retention_interval=prefix_cache_retention_interval, scheduler_extra=scheduler_extra,
            layers=layers, mamba_checkpoints=mamba_checkpoints, kv_events=kv_events is not None)
        run = _SchedRun(sched, reqs, tokens, hasher, recs, step_time)
        if kv_events is not None:
            if hasher is None:
                raise ValueError("KV events are compared with prefix caching on")
            sched.kv_event_publisher = _EventSink(run, prefixes(tokens, hasher, block_size), kv_events)
        if queue_size > 1:  # async
            run.run_async(queue_size, num_gpu_blocks, block_size)
        else:
            run.run_sync(num_gpu_blocks, block_size)
    return [recs[r.id] for r in reqs]


def prepare(requests: Iterable[Request], *, step_time: float | None, scheduling: str, max_num_batched_tokens: int,
            max_num_seqs: int, enable_chunked_prefill: bool, long_prefill_token_threshold: int,
            max_model_len: int | None = None):
    """Checked arguments for a run: (requests, their token ids, empty records by id, max_model_len).
    With `max_model_len` (kvsim's `--max-model-len`) vLLM gets that one and stops a request there."""
    if step_time is not None and step_time <= 0:
        raise ValueError(f"step_time must be positive, got {step_time}")
    if scheduling not in ("fcfs", "priority"):
        raise ValueError(f"scheduling must be 'fcfs' or 'priority', got {scheduling!r}")
    require_vllm()

    reqs = list(requests)
    check_ids(reqs)
    longest = max((r.prompt_len + max(r.output_len, 1) for r in reqs), default=1)
    if max_model_len is not None:
        longest = min(longest, max_model_len)
    else:
        # NOTE: any max_model_len >= the longest request schedules the same; the other
        # terms only keep vLLM's config checks quiet (its warnings, its threshold check).
        max_model_len = max(longest, -(-max_num_batched_tokens // max_num_seqs),
                            long_prefill_token_threshold)
    if not enable_chunked_prefill:
        if longest > max_num_batched_tokens:
            raise ValueError(
                f"without chunked prefill vLLM needs max_num_batched_tokens >= the longest "
                f"request ({longest} tokens), got {max_num_batched_tokens}")
        max_model_len = min(max_model_len, max_num_batched_tokens)
    tokens = [token_ids(r, uid) for uid, r in enumerate(reqs)]
    recs = {r.id: {"id": r.id, "first_scheduled_step": None, "first_token_step": None,
                   "finish_step": None, "preemptions": 0, "hit_tokens": 0} for r in reqs}
    return reqs, tokens, recs, max_model_len


class _SchedRun:
    """Arrivals, live requests and records shared by the sync and async scheduler loops."""

    def __init__(self, sched, reqs: list[Request], tokens: list[list[int]], hasher,
                 recs: dict, step_time: float):
        self.sched, self.reqs, self.tokens, self.hasher = sched, reqs, tokens, hasher
        self.recs, self.step_time = recs, step_time
        self.order = sorted(range(len(reqs)), key=lambda i: (reqs[i].arrival, i))
        self.nxt = 0
        self.live: dict[str, tuple[Any, list[int]]] = {}  # id -> (vLLM request, all its tokens)
        self.step = 0  # the step whose output is being applied
        self.churn = 0  # preemptions since a batch last decoded a token or a request last finished

    def _handed(self, out, start: float):
        """Step `out` is handed to the KV connector's worker at `start`: the connector output its
        runner returns, and whether a transfer was reported done (none here: no connector;
        sim.conform.vllm_offload's runs have one)."""
        return None, False

    def _ended(self, end: float) -> None:
        """The step last handed runs its forward until `end` (its start, without one)."""

    def _in_flight(self, now: float) -> bool:
        """Whether the connector's worker has a transfer in flight at `now` (none here: no connector)."""
        return False

    def pending(self) -> bool:
        return self.nxt < len(self.order)

    def next_arrival_step(self) -> int:
        return grid_index(self.reqs[self.order[self.nxt]].arrival, self.step_time)

    def add_arrivals(self, step: int) -> None:
        """Hand vLLM every request that arrived by `step` * step_time."""
        reqs, order = self.reqs, self.order
        while self.nxt < len(order) and reqs[order[self.nxt]].arrival <= step * self.step_time:
            i = order[self.nxt]
            vreq = vllm_request(reqs[i], self.tokens[i], self.hasher, arrival=reqs[i].arrival)
            self.live[reqs[i].id] = (vreq, self.tokens[i])
            self.sched.add_request(vreq)
            self.nxt += 1

    def stalled(self, steps: int, step: int, num_gpu_blocks: int, block_size: int):
        stuck = ", ".join(sorted(self.live)[:5])
        return RuntimeError(
            f"vLLM scheduled nothing for {steps} steps (up to step {step}) with "
            f"requests left ({stuck}); a request that can never fit in {num_gpu_blocks} "
            f"blocks of {block_size} stalls vLLM")

    def cycled(self, out) -> None:
        """Count batch `out`'s preemptions unless it decodes a token, as kvsim's engine counts them
        (`Engine._steps`, `LIVELOCK_PREEMPTIONS`): that many in a row, none of them followed by a
        decoded token or a finished request, and the requests preempt each other in a cycle that
        never ends (RuntimeError). `schedule()` has already advanced each request's computed tokens."""
        live = self.live
        for rid, n in out.num_scheduled_tokens.items():
            vreq = live[rid][0]
            if n == 1 and vreq.num_computed_tokens > vreq.num_prompt_tokens:  # a decode
                self.churn = 0
                return
        if out.preempted_req_ids:
            self.churn += len(out.preempted_req_ids)
            if self.churn >= loop.LIVELOCK_PREEMPTIONS:
                stuck = ", ".join(sorted(live)[:5])
                raise RuntimeError(f"vLLM cycled: {self.churn:,} preemptions in a row with no token decoded and no "
                                   f"request finished, up to step {self.step} ({stuck} left)")

    def run_sync(self, num_gpu_blocks: int, block_size: int) -> None:
        from vllm.v1.outputs import ModelRunnerOutput

        sched = self.sched
        step, idle = 0, 0
        while self.pending() or sched.get_num_unfinished_requests():
            if not sched.get_num_unfinished_requests():
                step = max(step, self.next_arrival_step())
            self.add_arrivals(step)
            out = sched.schedule()
            ids = self.sync_step(out, step, ModelRunnerOutput)
            idle = 0 if ids else idle + 1
            if idle >= STALL_STEPS:
                raise self.stalled(STALL_STEPS, step, num_gpu_blocks, block_size)
            step += 1

    def sync_step(self, out, step: int, output_cls, kv_connector_output=None) -> list[str]:
        """Run `out` as step `step` of the sync loop: sample, apply, record; the ids it scheduled."""
        live, recs = self.live, self.recs
        self.cycled(out)
        _record_admissions(out, live, recs, step)
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            vreq, toks = live[rid]
            # NOTE: schedule() already advanced num_computed_tokens by this step's chunk.
            done_prefill = vreq.num_computed_tokens >= vreq.num_tokens
            sampled.append([toks[vreq.num_tokens]] if done_prefill else [])
        mro = output_cls(req_ids=ids, req_id_to_index={r: j for j, r in enumerate(ids)},
                         sampled_token_ids=sampled, kv_connector_output=kv_connector_output)
        self.step = step
        self.sched.update_from_output(out, mro)
        for rid, toks in zip(ids, sampled, strict=True):
            rec, vreq = recs[rid], live[rid][0]
            if toks and rec["first_token_step"] is None:
                rec["first_token_step"] = step
            if vreq.is_finished():
                rec["finish_step"] = step
                rec["preemptions"] = vreq.num_preemptions
                del live[rid]
                self.churn = 0
        return ids

    def run_async(self, queue_size: int, num_gpu_blocks: int, block_size: int) -> None:
        """EngineCore.run_busy_loop over step_with_batch_queue, on the step grid."""
        from vllm.v1.outputs import ModelRunnerOutput

        sched, live, recs = self.sched, self.live, self.recs
        # (scheduler output, fake runner output, slot or None for a batch without tokens, its step)
        queue: deque[tuple[Any, Any, int | None, int]] = deque()
        clock = 0  # the engine's time, in steps (always on the grid)
        free_slot = 0  # first slot the device has not been given yet
        empties = 0  # consecutive batches scheduled without tokens
        while self.pending() or sched.has_requests() or queue:
            if not sched.has_requests() and not queue:  # idle: wait for the next arrival
                clock = max(clock, self.next_arrival_step())
            self.add_arrivals(clock)
            if sched.has_requests():
                start = max(free_slot, clock)  # the slot it would run in
                out = sched.schedule()
                self.cycled(out)
                kv_out, _ = self._handed(out, start * self.step_time)
                mro = self._fake_async_output(out, ModelRunnerOutput)
                mro.kv_connector_output = kv_out
                executed = out.total_num_scheduled_tokens > 0
                slot = None
                if executed:
                    slot, free_slot, empties = start, start + 1, 0
                    _record_admissions(out, live, recs, slot)
                    self._ended((slot + 1) * self.step_time)
                else:
                    self._ended(start * self.step_time)  # no forward
                    # (as kvsim's loop: a transfer in flight lands later, `Scheduler.in_flight`)
                    empties = 0 if self._in_flight(start * self.step_time) else empties + 1
                    if empties >= STALL_STEPS:
                        raise self.stalled(STALL_STEPS, clock, num_gpu_blocks, block_size)
                    if all(s is None for _, _, s, _ in queue):
                        clock += 1  # nothing executing: the engine spins for a step
                queue.appendleft((out, mro, slot, start))
                if len(queue) < queue_size and (executed or sched.has_requests()):
                    continue
            elif not queue:
                continue
            out, mro, slot, self.step = queue.pop()  # (the step KV events are published under, as kvsim's)
            if slot is not None:
                clock = max(clock, slot + 1)  # block until the batch's slot ends
            self.apply_async(out, mro, slot)

    def apply_async(self, out, mro, step: int | None) -> list[str]:
        """Apply batch `out`'s runner output `mro` (`update_from_output`), recording first tokens and
        finishes at `step`; the ids of the requests it finished, in batch order."""
        live, recs = self.live, self.recs
        before = {rid: live[rid][0].num_output_tokens for rid in mro.req_ids if rid in live}
        self.sched.update_from_output(out, mro)
        done = []
        for rid, n in before.items():
            rec, vreq = recs[rid], live[rid][0]
            if vreq.num_output_tokens > n and rec["first_token_step"] is None:
                rec["first_token_step"] = step
            if vreq.is_finished():
                rec["finish_step"] = step
                rec["preemptions"] = vreq.num_preemptions
                del live[rid]
                done.append(rid)
                self.churn = 0
        return done

    def _fake_async_output(self, out, output_cls):
        """What the runner returns for `out`, fixed when it is scheduled (as a device is)."""
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            vreq, toks = self.live[rid]
            if vreq.is_prefill_chunk:
                sampled.append([])
                continue
            # schedule() already counted this batch's placeholder: the token it samples
            # follows the known tokens and the earlier in-flight placeholders.
            pos = vreq.num_tokens + vreq.num_output_placeholders - 1
            # NOTE: past the request's last token only if vLLM schedules a step beyond
            # max_tokens; update_from_output then drops it (the request has finished).
            sampled.append([toks[pos] if pos < len(toks) else 0])
        return output_cls(req_ids=ids, req_id_to_index={r: j for j, r in enumerate(ids)},
                          sampled_token_ids=sampled)


def _record_admissions(out, live: dict, recs: dict, step: int) -> None:
    """First scheduling of each request: its step and vLLM's own record of its prefix hit."""
    for rid in out.num_scheduled_tokens:
        rec = recs[rid]
        if rec["first_scheduled_step"] is not None:
            continue
        rec["first_scheduled_step"] = step
        # prefill_stats is set at the admission lookup (and kept across preemptions);
        # it is handed out with the request's first output, after this point.
        stats = live[rid][0].prefill_stats
        rec["hit_tokens"] = stats.num_local_cached_tokens if stats is not None else 0


def prefixes(tokens: list[list[int]], hasher, block_size: int) -> dict[Any, PrefixName]:
    """Each block hash vLLM's events may carry (`maybe_convert_block_hash` of the requests' block
    hashes over all their tokens) -> the name of the prefix that block ends (`prefix_names`)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    from vllm.v1.request import Request as VllmRequest

    out: dict[Any, PrefixName] = {}
    for i, toks in enumerate(tokens):
        whole = VllmRequest(request_id=f"prefixes-{i}", prompt_token_ids=toks, sampling_params=SamplingParams(),
                            pooling_params=None, block_hasher=hasher)
        out.update((maybe_convert_block_hash(h), name)
                   for h, name in zip(whole.block_hashes, prefix_names(toks, block_size), strict=True))
    return out


class _EventSink:
    """Stands in for the scheduler's KV-event publisher (`Scheduler.kv_event_publisher`, which
    `update_from_output` hands each step's non-empty batch): keeps (step, events) with hashes named
    by their prefixes."""

    def __init__(self, run: _SchedRun, names: dict[Any, PrefixName], out: list):
        self.run, self.names, self.out = run, names, out

    def publish(self, batch) -> None:
        self.out.append((self.run.step, [self._event(e) for e in batch.events]))

    def _event(self, e) -> dict:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockStored

        names = self.names
        if isinstance(e, AllBlocksCleared):
            return {"type": "AllBlocksCleared"}
        named = {"type": type(e).__name__, "block_hashes": [names.get(h, h) for h in e.block_hashes]}
        if isinstance(e, BlockStored):
            parent = e.parent_block_hash
            named.update(parent_block_hash=None if parent is None else names.get(parent, parent),
                         token_ids=list(e.token_ids), block_size=e.block_size)
        return {**named, "medium": e.medium, "group_idx": e.group_idx}

    def shutdown(self) -> None:
        return None
