"""vLLM 0.33.0's own Scheduler on the cost model's clock, for diffing against a default `kvsim run`.

The grid drivers (`sim.conform.vllm_scheduler`) give every step the same length, and kvsim
turns its speed shortcuts' quiet runs and its closed-loop sessions off on a grid. Here instead
each step of vLLM's lasts what kvsim's cost model gives for the batch vLLM itself scheduled
(its prefill, decode and context tokens and its sequences, `CostModel.step_time`), so identical
schedules give identical clocks, and requests reach vLLM through kvsim's own front end
(`sim.engine.frontend`: arrival times, and closed-loop session turns released `think_time` after
the previous turn is done). A default `kvsim run` steps this way; its shortcuts stay on.

The loop is the engine's (`sim.engine.loop.Engine._steps`, one loop for both output modes), written
over vLLM's scheduler: with nothing unfinished it sleeps until a request arrives; a step scheduled
at T ends at T + its cost, every arrival up to then is queued before its output is applied, and
the requests it finished are done at its end. Steps are numbered by the batches that ran.
A request's arrival_time is the moment it reached the engine (vLLM's front end stamps it on
receipt), which orders priority scheduling.
"""

from __future__ import annotations

import tempfile
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from kvsim.sim.conform.vllm_offload import (
    FakeWorker,
    Offloading,
    _OffloadRun,
)
from kvsim.sim.conform.vllm_scheduler import (
    Request,
    _build_scheduler,
    _record_admissions,
    prepare,
)
from kvsim.sim.conform.vllm_setup import STALL_STEPS, vllm_request
from kvsim.sim.engine.scheduler import fan_out

# (prefill, decode, context tokens, seqs, each prefill chunk's (prior, new)) -> seconds
StepSeconds = Callable[[int, int, int, int, list[tuple[int, int]]], float]


def run_timed(
    requests: Iterable[Request], *, step_seconds: StepSeconds, block_size: int, num_gpu_blocks: int,
    max_num_batched_tokens: int, max_num_seqs: int, enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = True, long_prefill_token_threshold: int = 0, watermark: float = 0.0,
    scheduling: str = "fcfs", async_scheduling: bool | None = False, sliding_window: int | None = None,
    max_model_len: int | None = None, scheduler_extra: dict[str, Any] | None = None,
    load: float = 1.0, closed_loop: bool = True, offloading: Offloading | None = None,
    prefix_cache_retention_interval: int | None = 0, layers: Any = None, mamba_checkpoints: bool = False,
    nixl: Any = None,
) -> list[dict]:
    """Run vLLM's Scheduler (AsyncScheduler if `async_scheduling`) on the cost clock; one record
    per request in workload order (fanned-out samples as their own requests), as
    `sim.conform.vllm_scheduler.run_scheduler` gives them. `offloading`: with its
    OffloadingConnector and the fake worker of `sim.conform.vllm_offload` (records gain
    `offload_hit_tokens`); `nixl` (a `sim.conform.vllm_nixl.Nixl`): with P/D disaggregation's
    NixlConnector in one role, the requests as its proxy sends them, and its fake worker."""
    import simpy

    from kvsim.sim.engine.frontend import Frontend

    parents = list(requests) if nixl is None else nixl.requests(requests)
    samples = [s for r in parents for s in fan_out(r)]
    reqs, tokens, recs, max_model_len = prepare(
        samples, step_time=None, scheduling=scheduling, max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs, enable_chunked_prefill=enable_chunked_prefill,
        long_prefill_token_threshold=long_prefill_token_threshold, max_model_len=max_model_len)
    offload_kw = {} if offloading is None else {"offloading": offloading.prepare(recs, block_size, num_gpu_blocks)}
    with tempfile.TemporaryDirectory(prefix="kvsim-vllm-") as tmp:
        sched, hasher, queue_size = _build_scheduler(
            tmp, block_size=block_size, num_gpu_blocks=num_gpu_blocks,
            max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs, enable_chunked_prefill=enable_chunked_prefill,
            enable_prefix_caching=enable_prefix_caching,
            long_prefill_token_threshold=long_prefill_token_threshold, watermark=watermark,
            scheduling=scheduling, async_scheduling=async_scheduling, sliding_window=sliding_window,
            prefix_cache_retention_interval=prefix_cache_retention_interval, scheduler_extra=scheduler_extra,
            layers=layers, mamba_checkpoints=mamba_checkpoints,
            kv_transfer=None if nixl is None else nixl.extra_config(), **offload_kw)
        env = simpy.Environment()
        run_class = _TimedRun if nixl is None else nixl.run_class
        run = run_class(sched, reqs, tokens, hasher, recs, env, step_seconds, (num_gpu_blocks, block_size))
        if offloading is not None:
            run.worker = offloading.worker(sched)
        if nixl is not None:
            run.worker = nixl.worker(sched, block_size)
        front = Frontend(env, parents, run.admit, load=load, closed_loop=closed_loop)
        run.front = front
        env.process(run.run(queue_size))
        env.run()
        if sched.get_num_unfinished_requests() or run.open:
            raise RuntimeError(f"vLLM left {sched.get_num_unfinished_requests()} requests unfinished")
    return [recs[r.id] for r in reqs]


def batch_shape(out, live: dict) -> tuple[int, int, int, int, list[tuple[int, int]]]:
    """(prefill tokens, decode tokens, context tokens, sequences, each prefill chunk's (prior, new))
    of vLLM's scheduled batch `out`, as kvsim's engine counts a batch
    (`sim.engine.scheduler.Scheduler._add`): a decode is one token past the prompt; the context is
    each sequence's length after the step. `schedule()` has already advanced each request's
    computed tokens by its chunk."""
    prefill = decode = context = 0
    chunks = []
    for rid, n in out.num_scheduled_tokens.items():
        vreq = live[rid][0]
        c = vreq.num_computed_tokens - n
        context += c + n
        if n == 1 and c >= vreq.num_prompt_tokens:
            decode += 1
        else:
            prefill += n
            chunks.append((c, n))
    return prefill, decode, context, len(out.num_scheduled_tokens), chunks


class _TimedRun(_OffloadRun):
    """The engine's step loops over vLLM's scheduler, on the cost clock (see the module docstring);
    with `worker`, the offloading connector's fake worker is handed each step as it is scheduled."""

    def __init__(self, sched, reqs: list[Request], tokens: list[list[int]], hasher, recs: dict, env,
                 step_seconds: StepSeconds, cache: tuple[int, int]):
        super().__init__(sched, reqs, tokens, hasher, recs, step_time=1.0)
        self.env, self.step_seconds, self.cache = env, step_seconds, cache
        self.index = {r.id: i for i, r in enumerate(reqs)}
        self.parent: dict[str, Request] = {}  # sample id -> the request it came from
        self.open: dict[str, int] = {}  # request id -> samples not yet finished
        self.front = None
        self.worker: FakeWorker | None = None  # with a connector (`_handed`, `_ended`: sim.conform.vllm_offload)

    def admit(self, req: Request) -> None:
        """`req` reaches the engine now: its samples are added to vLLM, stamped with the time."""
        kids = fan_out(req)
        self.open[req.id] = len(kids)
        for s in kids:
            i = self.index[s.id]
            vreq = vllm_request(s, self.tokens[i], self.hasher, arrival=self.env.now,
                                kv_transfer_params=self._transfer_params(s))
            self.live[s.id] = (vreq, self.tokens[i])
            self.parent[s.id] = req
            self.sched.add_request(vreq)

    def _transfer_params(self, req: Request) -> dict[str, Any] | None:
        """The kv_transfer_params `req` comes with (none: no P/D proxy; sim.conform.vllm_nixl's)."""
        return None

    def _finished(self, ids: Iterable[str], step: int, now: float) -> None:
        """Of the samples `ids` (in batch order), those whose last token step `step` sampled are done
        at `now`; a request is done with its last sample."""
        for rid in ids:
            if self.recs[rid]["finish_step"] != step or rid not in self.parent:
                continue
            req = self.parent.pop(rid)
            left = self.open[req.id] - 1
            if left:
                self.open[req.id] = left
                continue
            del self.open[req.id]
            self.front.done(req, now)

    def run(self, queue_size: int):
        """`Engine._steps` (step_time None) over vLLM's Scheduler (`queue_size` 1) or
        AsyncScheduler (2): EngineCore's step_with_batch_queue, each batch lasting its cost from
        when the device is free; the requests that arrive while it runs are queued before its
        output is applied. No shortcuts are needed: vLLM visits every request."""
        from vllm.v1.outputs import ModelRunnerOutput

        env, sched, live, recs, front, worker = self.env, self.sched, self.live, self.recs, self.front, self.worker
        sync = queue_size == 1
        if not sync:
            busy = sched.has_requests
        else:  # vLLM EngineCore: with a connector, transfers in flight keep it stepping (`has_requests`)
            busy = sched.has_requests if worker is not None else sched.get_num_unfinished_requests
        spin = None if sync else self.step_seconds(0, 0, 0, 0, [])  # an empty schedule with nothing running
        queue: deque[tuple[Any, Any, float | None, float, int]] = deque()  # (out, output, start, end, step)
        clock = free = env.now
        k = empties = 0
        while True:
            if not queue and not busy():
                if clock > env.now:  # catch up first: an arrival may be due meanwhile
                    yield env.timeout(clock - env.now)
                    continue
                if front.idle():
                    break
                yield from front.wait()
                clock = max(clock, env.now)
                continue
            if sched.has_requests():
                start = max(free, clock)
                out = sched.schedule()
                kv_out, landed = self._handed(out, start)
                ran = out.total_num_scheduled_tokens > 0
                if ran or (sync and out.preempted_req_ids):
                    end = start + self.step_seconds(*batch_shape(out, live))
                    free = end
                    if sync:
                        output = kv_out  # sampled when it is applied (sync_step)
                    else:
                        self.cycled(out)  # (sync: when it is applied, sync_step)
                        self._ended(end)
                        output = self._fake_async_output(out, ModelRunnerOutput)
                        output.kv_connector_output = kv_out
                        _record_admissions(out, live, recs, k)
                    queue.appendleft((out, output, start, end, k))
                    k += 1
                    empties = 0
                elif sync:
                    if worker is None:
                        raise self.stalled(1, k, *self.cache)
                    # kvsim's empty step (Engine._steps, Scheduler.idle_until): no forward, its loads start
                    # now; again at once if a transfer landed, else at the next transfer's end or arrival
                    self.sync_step(out, k, ModelRunnerOutput, kv_out)
                    self._ended(start)
                    until = start if landed or not busy() else worker.busy_until(start)
                    if until is None:
                        raise self.stalled(1, k, *self.cache)
                    if until > start:
                        clock = min(until, max(env.peek(), start))
                        yield from front.upto(clock)
                    continue
                else:
                    output = self._fake_async_output(out, ModelRunnerOutput)
                    output.kv_connector_output = kv_out
                    self._ended(start)  # no forward: its loads start at once
                    # (as kvsim's loop: a transfer in flight lands later, `Scheduler.in_flight`)
                    empties = 0 if self._in_flight(start) else empties + 1
                    if empties >= STALL_STEPS:
                        raise self.stalled(STALL_STEPS, k, *self.cache)
                    if all(q[2] is None for q in queue):
                        clock += spin  # nothing running: the engine spins
                        yield from front.upto(clock)
                    queue.appendleft((out, output, None, clock, k))
                if len(queue) < queue_size and (ran or sched.has_requests()):
                    continue
            out, output, start, end, step = queue.pop()
            if start is None:
                sched.update_from_output(out, output)  # nothing ran; the scheduler only hears of it
                continue
            clock = max(clock, end)
            yield from front.upto(clock)  # arrivals while it ran are queued before its output
            if sync:
                done = self.sync_step(out, step, ModelRunnerOutput, output)
                self._ended(end)
            else:
                done = self.apply_async(out, output, step)
            self._finished(done, step, end)
