"""The file tier's I/O threads, timed: vLLM 0.33's `DualQueueThreadPool`
(vllm/v1/kv_offload/tiering/fs/thread_pool.py) with a fixed cost per chunk instead of disks.

Promotions (loads) and cascades (stores) queue first in, first out in two queues.
`read_threads` take a load when one is queued, else a store; `write_threads` the
reverse. A job is one task (vLLM enqueues each job as one task), so one thread
moves its chunks one after another: `len(keys) * seconds_per_read` (or `_write`).
Jobs must be submitted in time order; `schedule(now)` starts every job a thread
would have taken by `now` and stamps its `done_at`. NOTE: vLLM skips a file that
exists (`_store_block`); the pool charges it all the same, so a job's time does not
depend on when the caller looks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

INF = float("inf")


@dataclass(slots=True)
class FsJob:
    """One transfer between host slots and files: a promotion (file -> slot) or a cascade
    (slot -> file), for `req`'s `keys` in host `slots` (vLLM's `TransferJob`)."""

    job_id: int
    promotion: bool
    req: str
    keys: list[int]
    slots: list[int]
    submitted_at: float = 0.0
    done_at: float = INF  # when its I/O ends (inf: not started, or finished by hand)


class IOPool:
    """Threads as free-at times; queued jobs in two FIFO queues."""

    def __init__(self, read_threads: int = 16, write_threads: int = 16, *,
                 seconds_per_read: float = 0.0, seconds_per_write: float = 0.0) -> None:
        if read_threads < 0 or write_threads < 0 or read_threads + write_threads == 0:
            raise ValueError(f"need at least one I/O thread, got {read_threads} read and "
                             f"{write_threads} write threads")
        self.read_threads = read_threads
        self.seconds_per_read = seconds_per_read
        self.seconds_per_write = seconds_per_write
        self.free_at = [0.0] * (read_threads + write_threads)
        self.loads: deque[FsJob] = deque()
        self.stores: deque[FsJob] = deque()

    def submit(self, job: FsJob) -> None:
        """Queue `job` (at its `submitted_at`)."""
        (self.loads if job.promotion else self.stores).append(job)

    def _queues(self, thread: int) -> tuple[deque[FsJob], deque[FsJob]]:
        """A thread's own queue first, then the other (vLLM `DualQueueThreadPool._worker`)."""
        if thread < self.read_threads:
            return self.loads, self.stores
        return self.stores, self.loads

    def _next(self) -> tuple[float, bool, int] | None:
        """The earliest start: (time, takes from its other queue, thread); ties go to a thread
        whose own queue holds the job, then to the lowest thread."""
        best = None
        for thread, free in enumerate(self.free_at):
            own, other = self._queues(thread)
            heads = [q[0].submitted_at for q in (own, other) if q]
            if not heads:
                return None
            t = max(free, min(heads))
            candidate = (t, not (own and own[0].submitted_at <= t), thread)
            if best is None or candidate < best:
                best = candidate
        return best

    def next_start(self) -> float | None:
        """When the next queued job starts, or None if none is queued."""
        nxt = self._next()
        return None if nxt is None else nxt[0]

    def schedule(self, now: float) -> None:
        """Start, in time order, every queued job some thread takes by `now`."""
        while True:
            nxt = self._next()
            if nxt is None or nxt[0] > now:
                return
            t, other, thread = nxt
            own, second = self._queues(thread)
            job = (second if other else own).popleft()
            cost = self.seconds_per_read if job.promotion else self.seconds_per_write
            job.done_at = self.free_at[thread] = t + len(job.keys) * cost
