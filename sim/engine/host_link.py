"""The host link of KV offloading: one direction's copies, run one after another in the order
they start, as vLLM 0.33's CPU offloading worker runs them (vllm/v1/kv_offload/cpu/gpu_worker.py
`SingleDirectionOffloadingHandler`). Timed by `sim.engine.offload.Offloader` and by the fake
worker of `kvsim conform` (`sim.conform.vllm_offload.FakeWorker`)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

INF = float("inf")


@dataclass(slots=True)
class Job:
    """One transfer: `load` (host -> GPU) or `store`, of whole chunks."""

    kind: str
    sid: str
    keys: list[int]
    blocks: int  # GPU blocks moved
    done_at: float = INF  # when the link finishes it (inf: not started)
    block_ids: tuple[int, ...] = ()  # a store's GPU blocks (the flush fence, once its request finished)


class Link:
    """One direction of the host link: jobs run one after another in the order started (vLLM
    gpu_worker.py `SingleDirectionOffloadingHandler.transfer_async`: a copy waits for the last)."""

    def __init__(self, seconds_per_block: float):
        self.seconds_per_block = seconds_per_block
        self.queue: deque[Job] = deque()  # started, in order (those done by the last start dropped)

    def start(self, job: Job, at: float) -> None:
        queue = self.queue
        while queue and queue[0].done_at <= at:
            queue.popleft()
        job.done_at = (max(at, queue[-1].done_at) if queue else at) + job.blocks * self.seconds_per_block
        queue.append(job)

    def wait(self, job: Job, now: float) -> None:
        """The worker waits at `now` for `job` (vLLM `SingleDirectionOffloadingHandler.wait`, on its end
        event), so for the jobs ahead too: they are done at `now`, taking no time, and those behind
        start over from `now`. A job not started yet is first queued behind all others."""
        if job.done_at <= now:
            return
        if job.done_at == INF:
            self.queue.append(job)
        while (ahead := self.queue.popleft()) is not job:
            ahead.done_at = min(ahead.done_at, now)
        job.done_at = now
        behind, self.queue = list(self.queue), deque()
        for other in behind:
            self.start(other, now)
