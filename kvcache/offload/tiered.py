"""The host tier with a file tier below it, as vLLM 0.33's `TieringOffloadingManager`
(vllm/v1/kv_offload/tiering/manager.py) with one `fs` secondary tier.

Only the host tier talks to the GPU. A chunk stored to the host is copied on to the
files once its store completes (a cascade: its host slot is pinned meanwhile). A key
missing from the host is probed in the files (RETRY until the probe is back); a file
hit is promoted: a host slot is taken at once (the lookup says PENDING), the read is
submitted at the end of the step, and once it is done the chunk is an ordinary host
chunk, loaded to the GPU as any other. Finished file jobs are applied at the step's
first lookup, at every `prepare_store`, or at `end_step`, whichever comes first.

The methods are HostTier's, plus the request on `lookup` and `complete_store`, and
two per-step calls: `advance(now)` before the schedule and `end_step(now)` after it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvsim.kvcache.offload.fs import FileTier, FsResult
from kvsim.kvcache.offload.fs_pool import FsJob
from kvsim.kvcache.offload.tier import HIT, MISS, PENDING, HostTier, StoreOutput

RETRY = 3  # lookup: a probe is out; ask again next step (vLLM LookupResult.RETRY)


class PrimaryTier(HostTier):
    """HostTier plus the pins a cascade holds while it reads a slot (vLLM's
    `CPUPrimaryTierOffloadingManager.prepare_read`): pinned, but no request access."""

    def prepare_read(self, keys: Sequence[int]) -> list[int]:
        """Pin ready chunks for a copy to the files and return their slots."""
        return self._pin(keys, "cascaded")


@dataclass(slots=True)
class _Request:
    """vLLM's `RequestState`: stores to the host still to complete, and whether it finished."""

    pending_stores: int = 0
    finished: bool = False


@dataclass(slots=True)
class _Promotions:
    """One request's promotions taken this step, submitted as one job at its end."""

    keys: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)


class TieredTier:
    """A `PrimaryTier` of `num_chunks` host chunks over a `FileTier` (see the module docstring)."""

    def __init__(self, num_chunks: int, policy: str = "lru", *, files: FileTier | None = None,
                 store_threshold: int = 0) -> None:
        if store_threshold >= 2:  # vLLM TieringOffloadingSpec.get_manager
            raise ValueError(f"store_threshold {store_threshold} is not supported with a file tier")
        self.host = PrimaryTier(num_chunks, policy)
        self.files = files if files is not None else FileTier()
        self._jobs: dict[int, FsJob] = {}
        self._next_job = 0
        self._requests: dict[str, _Request] = {}
        self._promotions: dict[str, _Promotions] = {}
        self._sources: dict[str, set[int]] = {}  # request -> keys it promoted from the files
        self._polled = False  # this step's once-per-step poll is done
        self._held = False  # promotions held after a reset, until `reset_flushed`
        self.num_promoted = 0  # chunks given a host slot to read from the files
        self.num_promotion_failures = 0  # file hits the host had no room for
        self.num_cascaded = 0  # chunks submitted for copying to the files
        self.on_done: Callable[[FsJob, tuple[int, ...]], None] | None = None  # (job, keys that made it) as applied

    # ------------------------------------------------------------- HostTier's figures
    @property
    def num_chunks(self) -> int:
        return self.host.num_chunks

    @property
    def num_evictions(self) -> int:
        return self.host.num_evictions

    @property
    def num_alloc_failures(self) -> int:
        """`prepare_store` calls that returned None (promotions' failures are counted apart)."""
        return self.host.num_alloc_failures - self.num_promotion_failures

    def resident(self) -> dict[int, int]:
        return self.host.resident()

    def jobs(self) -> dict[int, FsJob]:
        """The file jobs in flight, by id."""
        return dict(self._jobs)

    def _request(self, req: str) -> _Request:
        st = self._requests.get(req)
        if st is None:
            st = self._requests[req] = _Request()
        return st

    # ------------------------------------------------------------- polling
    def _poll_once(self) -> None:
        """The step's first poll (vLLM `_maybe_process_finished_jobs`)."""
        if not self._polled:
            self._polled = True
            self._process_finished()

    def _process_finished(self) -> None:
        """Apply finished file jobs (vLLM `_process_finished_jobs`): a cascade unpins its host
        chunks; a promotion makes its read chunks ready and drops the rest."""
        for result in self.files.get_finished_jobs():
            job = self._jobs.pop(result.job_id)
            if self.on_done is not None:
                self.on_done(job, tuple(job.keys) if result.success else result.loaded)
            if job.promotion:
                self._complete_promotion(job, result)
            else:
                self.host.complete_load(job.keys)

    def _complete_promotion(self, job: FsJob, result: FsResult) -> None:
        """vLLM `_complete_promotion`. NOTE: vLLM frees a partly failed job's unread slots in set
        order (hash-seeded); here in key order."""
        if result.success:
            self.host.complete_store(job.keys)
            return
        loaded = set(result.loaded)
        sources = self._sources.get(job.req)
        if sources is not None:
            sources.difference_update(k for k in job.keys if k not in loaded)
        if loaded:
            self.host.complete_store(list(result.loaded))
        self.host.complete_store([k for k in job.keys if k not in loaded], success=False)

    # ------------------------------------------------------------- lookups and loads
    def lookup(self, req: str, key: int, position: int) -> int:
        """HIT or PENDING from the host; else RETRY while the file's probe is out, MISS if no
        file (or the host has no room to promote it, or promotions are held); a file hit takes
        a host slot for the promotion and is PENDING (vLLM `TieringOffloadingManager.lookup`,
        `_initiate_promotion`). `position` is the chunk's end token."""
        self._poll_once()
        r = self.host.lookup(key)
        return r if r != MISS else self._from_files(req, key, position)

    def lookup_chunks(self, req: str, keys: Sequence[int], first: int, tokens_per_chunk: int) -> tuple[int, bool]:
        """`lookup` of `keys` (chunks first, first + 1, ...) in order up to the first MISS, as the
        connector scans them: (hits: HIT or PENDING, whether any was PENDING or RETRY)."""
        if not keys:
            return 0, False
        self._poll_once()
        ref = self.host._ref
        hits, defer = 0, False
        for i, key in enumerate(keys, first):
            r = ref.get(key)
            if r is None:
                r = self._from_files(req, key, (i + 1) * tokens_per_chunk)
                if r == MISS:
                    break
                if r == RETRY:
                    defer = True
                    continue
                r = -1  # PENDING: a promotion
            hits += 1
            defer |= r < 0
        return hits, defer

    def _from_files(self, req: str, key: int, position: int) -> int:
        """A host miss: MISS, RETRY, or PENDING with a promotion started (see `lookup`)."""
        if self._held:
            return MISS
        self._request(req)
        found = self.files.lookup(req, key)
        if found is None:
            return RETRY
        if not found:
            return MISS
        out = self.host.prepare_store(req, [key], [position])
        if out is None:
            self.num_promotion_failures += 1
            return MISS
        self._sources.setdefault(req, set()).update(out.keys)
        pending = self._promotions.setdefault(req, _Promotions())
        pending.keys.extend(out.keys)
        pending.slots.extend(out.slots)
        self.num_promoted += len(out.keys)
        return PENDING

    def from_files(self, req: str, key: int) -> bool:
        """Whether `req` loads `key` because it promoted it from the files: a disk hit, not a host
        hit, for the metrics (vLLM `get_load_source`)."""
        return key in self._sources.get(req, ())

    def prepare_load(self, req: str, keys: Sequence[int], positions: Sequence[int]) -> list[int]:
        """Pin ready host chunks for a load to the GPU (HostTier's)."""
        self._request(req)
        return self.host.prepare_load(req, keys, positions)

    def complete_load(self, keys: Sequence[int]) -> None:
        """A load to the GPU finished (HostTier's)."""
        self.host.complete_load(keys)

    # ------------------------------------------------------------- stores
    def prepare_store(self, req: str, keys: Sequence[int], positions: Sequence[int]) -> StoreOutput | None:
        """Apply every finished file job first, so eviction sees their unpins, then HostTier's
        `prepare_store` (vLLM `TieringOffloadingManager.prepare_store`)."""
        self._polled = True
        self._process_finished()
        out = self.host.prepare_store(req, keys, positions)
        if out is not None and out.keys:
            self._request(req).pending_stores += 1
        return out

    def complete_store(self, keys: Sequence[int], success: bool = True, *, req: str,
                       now: float = 0.0) -> list[FsJob]:
        """`req`'s store of `keys` (one `prepare_store`'s output) to the host finished; on success
        the chunks are pinned and one cascade copies them to the files, submitted at `now`
        and returned (vLLM `TieringOffloadingManager.complete_store`)."""
        st = self._requests.get(req)
        if st is None or st.pending_stores <= 0:
            raise ValueError(f"request {req!r} has no store to the host in flight")
        self.host.complete_store(keys, success)
        jobs = []
        if success:
            slots = self.host.prepare_read(keys)
            job = FsJob(self._take_id(), False, req, list(keys), slots)
            self._jobs[job.job_id] = job
            self.files.submit(job, now)
            self.num_cascaded += len(keys)
            jobs.append(job)
        st.pending_stores -= 1
        self._maybe_finalize(req)
        return jobs

    def _take_id(self) -> int:
        job_id = self._next_job
        self._next_job += 1
        return job_id

    # ------------------------------------------------------------- requests and steps
    def request_finished(self, req: str) -> None:
        """Commit `req`'s accesses to the host policy; its probes are released once its stores to
        the host are done (vLLM `on_request_finished`, `_maybe_finalize_request`)."""
        self.host.request_finished(req)
        self._request(req).finished = True
        self._maybe_finalize(req)

    def _maybe_finalize(self, req: str) -> None:
        st = self._requests[req]
        if st.finished and st.pending_stores == 0:
            self.files.request_finished(req)
            self._sources.pop(req, None)
            del self._requests[req]

    def end_step(self, now: float = 0.0) -> list[FsJob]:
        """The schedule's last call, after its stores and finished requests: poll if no call did,
        submit one promotion job per request (in the order they first promoted), post the
        step's probes (vLLM `on_schedule_end`). Returns the promotion jobs."""
        self._poll_once()
        self._polled = False
        jobs = []
        for req, pending in self._promotions.items():
            job = FsJob(self._take_id(), True, req, pending.keys, pending.slots)
            self._jobs[job.job_id] = job
            self.files.submit(job, now)
            jobs.append(job)
        self._promotions.clear()
        self.files.flush(now)
        return jobs

    def advance(self, now: float) -> None:
        """Time passes to `now`: file jobs and probes done by then finish (applied at the next poll)."""
        self.files.advance(now)

    def has_pending_work(self) -> bool:
        """Whether file jobs are in flight: the engine must keep stepping (vLLM `has_pending_work`)."""
        return bool(self._jobs)

    def next_event(self) -> float | None:
        """When a file job or probe next finishes (with a timed pool), or None."""
        return self.files.next_event()

    # ------------------------------------------------------------- reset
    def reset(self) -> None:
        """vLLM `reset_cache`: every file job finishes and is applied, queued promotions are
        dropped, finished requests finalized, the host emptied; the files and probe verdicts
        stay. Promotions are held (a host miss is a MISS) until `reset_flushed`."""
        self.files.drain()
        self._process_finished()
        self._promotions.clear()
        self._sources.clear()
        for req, st in list(self._requests.items()):
            st.pending_stores = 0
            if st.finished:
                self.files.request_finished(req)
                del self._requests[req]
        self.host.reset()
        self._polled = False
        self._held = True

    def reset_flushed(self) -> None:
        """The workers reported every job in flight at the reset (vLLM `on_reset_flushed`)."""
        self._held = False


__all__ = ["HIT", "MISS", "PENDING", "RETRY", "FileTier", "FsJob", "PrimaryTier", "TieredTier"]
