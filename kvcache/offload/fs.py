"""The file-system tier below the host tier, as vLLM 0.33's `FileSystemTierManager`
(vllm/v1/kv_offload/tiering/fs/manager.py) with its asynchronous existence probes
(`AsyncLookupManager`, vllm/v1/kv_offload/tiering/async_lookup.py).

A chunk's file exists or not; nothing bounds how many exist and nothing evicts them
(vLLM never deletes one except after a short read). The scheduler never sees the
files directly: it asks for a key, gets None ("retry") until a probe of the file
has come back, and then the cached verdict, shared by every request that asked,
until the last of them is finalized.

Time is explicit. A probe batch posted by `flush` resolves when `run_probes` (or
`advance`) runs it; a transfer job finishes when `finish` (or `advance`, through an
`IOPool`) says so; what finished is reported by `get_finished_jobs`, which the
composing `TieredTier` polls.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvsim.kvcache.offload.fs_pool import INF, FsJob, IOPool

QUEUED, IN_FLIGHT, RESOLVED = 0, 1, 2  # a probe's phase (vLLM's LookupPhase)


@dataclass(frozen=True, slots=True)
class FsResult:
    """A finished job as `get_finished_jobs` reports it (vLLM's `JobResult`)."""

    job_id: int
    success: bool
    loaded: tuple[int, ...] = ()  # a failed promotion's keys that did load: a prefix of its keys


@dataclass(slots=True)
class _Probe:
    """One key's existence check (vLLM's `LookupState`); `found` is None until resolved."""

    generation: int
    phase: int = QUEUED
    found: bool | None = None
    reqs: set[str] = field(default_factory=set)


class FileTier:
    """The files (a set of keys), the probe cache, and the transfer jobs in flight."""

    def __init__(self, files: Iterable[int] = (), *, pool: IOPool | None = None,
                 seconds_per_probe: float = 0.0, capacity: int | None = None) -> None:
        self.files: set[int] = set(files)  # persists across resets and runs (a shared root_dir)
        self.capacity = capacity  # most files the disk holds (None: no limit); a write past it fails
        self.pool = pool  # None: jobs finish only through `finish`
        self.seconds_per_probe = seconds_per_probe  # the probe thread's time per key
        self._probes: dict[int, _Probe] = {}
        self._req_keys: dict[str, set[int]] = {}
        self._generation = 0
        self._batch: list[tuple[int, int]] = []  # (key, generation) asked since the last flush
        self._posted: deque[tuple[float, list[tuple[int, int]]]] = deque()  # (done at, batch)
        self._probe_free_at = 0.0
        self._results: list[list[tuple[int, int, bool]]] = []  # probed, not yet drained
        self._need_drain = False
        self._jobs: dict[int, FsJob] = {}
        self._done: list[tuple[FsJob, int]] = []  # finished jobs and how many keys made it
        self.num_probed = 0  # keys probed
        self.num_written = 0  # files created
        self.num_read = 0  # chunks read back into host slots
        self.num_failed_jobs = 0

    # ------------------------------------------------------------- probes
    def lookup(self, req: str, key: int) -> bool | None:
        """The cached verdict for `key` (True: its file exists), or None: asked, not yet known.

        The first lookup after a flush applies the probes that came back meanwhile
        (vLLM `AsyncLookupManager.lookup`).
        """
        if self._need_drain:
            self._drain()
            self._need_drain = False
        probe = self._probes.get(key)
        if probe is None:
            probe = self._probes[key] = _Probe(self._generation)
            self._generation += 1
            self._batch.append((key, probe.generation))
        probe.reqs.add(req)
        self._req_keys.setdefault(req, set()).add(key)
        return probe.found

    def flush(self, now: float = 0.0) -> None:
        """End of a schedule: apply returned probes, then post this step's new keys as one
        batch to the probe thread (vLLM `AsyncLookupManager.flush`, from `on_schedule_end`)."""
        self._drain()
        self._need_drain = True
        batch = []
        for key, generation in self._batch:
            probe = self._probes.get(key)
            if probe is None or probe.generation != generation:
                continue  # its requests all finished before the post
            probe.phase = IN_FLIGHT
            batch.append((key, generation))
        self._batch = []
        if batch:
            start = max(now, self._probe_free_at)
            self._probe_free_at = start + self.seconds_per_probe * len(batch)
            self._posted.append((self._probe_free_at, batch))

    def run_probes(self, upto: float = INF) -> None:
        """The probe thread checks, in post order, every batch done by `upto` against the files
        as they are now; the verdicts wait to be drained (vLLM `AsyncLookupManager._worker`)."""
        while self._posted and self._posted[0][0] <= upto:
            _, batch = self._posted.popleft()
            self._results.append([(key, gen, key in self.files) for key, gen in batch])
            self.num_probed += len(batch)

    def _drain(self) -> None:
        """Apply returned verdicts; one whose key no request still wants is dropped with its
        probe (vLLM `AsyncLookupManager.drain_results`)."""
        for results in self._results:
            for key, generation, found in results:
                probe = self._probes.get(key)
                if probe is None or probe.generation != generation:
                    continue
                if not probe.reqs:
                    del self._probes[key]
                    continue
                probe.found, probe.phase = found, RESOLVED
        self._results.clear()

    def mark_miss(self, keys: Iterable[int]) -> None:
        """Resolved verdicts for `keys` become False (a failed load; vLLM `mark_miss`, the
        livelock fix); a probe still queued or in flight keeps its own coming verdict."""
        for key in keys:
            probe = self._probes.get(key)
            if probe is not None and probe.phase == RESOLVED:
                probe.found = False

    def request_finished(self, req: str) -> None:
        """Release `req`'s probes; one nobody wants is forgotten unless in flight, whose verdict
        is then dropped when it comes back (vLLM `AsyncLookupManager.cleanup`)."""
        for key in self._req_keys.pop(req, ()):
            probe = self._probes[key]
            probe.reqs.discard(req)
            if not probe.reqs and probe.phase != IN_FLIGHT:
                del self._probes[key]

    def probe_state(self) -> dict[int, tuple[int, bool | None, frozenset[str]]]:
        """Every cached probe: key -> (phase, verdict, requests)."""
        return {k: (p.phase, p.found, frozenset(p.reqs)) for k, p in self._probes.items()}

    # ------------------------------------------------------------- jobs
    def submit(self, job: FsJob, now: float = 0.0) -> None:
        """Queue a promotion (file -> host slot) or a cascade (host slot -> file) at `now`
        (vLLM `submit_load` / `submit_store`)."""
        job.submitted_at = now
        self._jobs[job.job_id] = job
        if self.pool is not None:
            self.pool.submit(job)

    def jobs(self) -> dict[int, FsJob]:
        """The jobs in flight, by id."""
        return dict(self._jobs)

    def finish(self, job_id: int, *, fail_at: int | None = None, short_read: bool = False) -> None:
        """Job `job_id`'s I/O is over, failing at its key `fail_at` if given.

        A cascade writes its keys' files in order up to the failure (an existing file is
        kept; vLLM `batch_store_block`). A promotion reads in order and stops at the first
        missing file or at `fail_at`; a short read there deletes that file (vLLM
        `_load_block`). The result waits for `get_finished_jobs`.
        """
        job = self._jobs.pop(job_id)
        n = len(job.keys)
        stop = n if fail_at is None else min(fail_at, n)
        if job.promotion:
            missing = next((i for i, key in enumerate(job.keys) if key not in self.files), n)
            if short_read and stop < missing:
                self.files.discard(job.keys[stop])
            stop = min(stop, missing)
            self.num_read += stop
        else:
            new = []
            for i, key in enumerate(job.keys[:stop]):
                if key in self.files:
                    continue
                if self.capacity is not None and len(self.files) + len(new) >= self.capacity:
                    stop = i  # the disk is full: this write fails and stops the job (ENOSPC)
                    break
                new.append(key)
            self.files.update(new)
            self.num_written += len(new)
        self.num_failed_jobs += stop < n
        self._done.append((job, stop))

    def get_finished_jobs(self) -> list[FsResult]:
        """What finished since the last call, in finishing order; a failed promotion's unread
        keys are marked missing here (vLLM `FileSystemTierManager.get_finished_jobs`)."""
        out = []
        for job, stop in self._done:
            if stop == len(job.keys):
                out.append(FsResult(job.job_id, True))
                continue
            if job.promotion:
                self.mark_miss(job.keys[stop:])
            out.append(FsResult(job.job_id, False, tuple(job.keys[:stop])))
        self._done.clear()
        return out

    def drain(self) -> None:
        """Every job in flight finishes as its I/O would, in the order it would (vLLM
        `drain_jobs`: the pool waits idle). Probes are untouched."""
        if self.pool is not None:
            self.pool.schedule(INF)
        for job in sorted(self._jobs.values(), key=lambda j: (j.done_at, j.job_id)):
            self.finish(job.job_id)

    # ------------------------------------------------------------- time
    def advance(self, now: float) -> None:
        """Run, in time order, the pool's jobs and the probe batches done by `now` (jobs first
        at a tie: a file written is seen by a probe at the same instant)."""
        if self.pool is not None:
            self.pool.schedule(now)
        done = sorted((j.done_at, j.job_id) for j in self._jobs.values() if j.done_at <= now)
        for at, job_id in done:
            self.run_probes(_before(at))
            self.finish(job_id)
        self.run_probes(now)

    def next_event(self) -> float | None:
        """When a job or a probe batch next finishes, as far as known now; None if none."""
        times = [j.done_at for j in self._jobs.values() if j.done_at < INF]
        if self._posted:
            times.append(self._posted[0][0])
        if self.pool is not None:
            start = self.pool.next_start()
            if start is not None:
                times.append(start)
        return min(times, default=None)


def _before(t: float) -> float:
    """The largest float below `t`: probes strictly earlier than a job finishing at `t`."""
    return math.nextafter(t, -INF)
