"""The file tier and the tiered host on hand-worked sequences, each pinning one rule of vLLM
0.33's tiering (the file and function named in each test; paths under vllm/v1/kv_offload/).

Keys are small ints; a chunk's position is its end token, 16 tokens a chunk. The
sequences were also replayed on vLLM's own `TieringOffloadingManager` with its `fs` tier
(tests/kvcache/offload/test_fs_vs_vllm.py drives the two side by side).
"""

from __future__ import annotations

import pytest

from kvsim.kvcache.offload.arc import HostARC
from kvsim.kvcache.offload.fs import IN_FLIGHT, RESOLVED, FileTier, FsResult
from kvsim.kvcache.offload.fs_pool import FsJob, IOPool
from kvsim.kvcache.offload.tier import StoreOutput
from kvsim.kvcache.offload.tiered import HIT, MISS, PENDING, RETRY, TieredTier


def pos(key: int) -> int:
    """Key k sits at depth k // 10: its chunk ends at token 16 * (k // 10 + 1)."""
    return 16 * (key // 10 + 1)


def look(t: TieredTier, req: str, key: int) -> int:
    return t.lookup(req, key, pos(key))


def store(t: TieredTier, req: str, keys: list[int]) -> StoreOutput | None:
    return t.prepare_store(req, keys, [pos(k) for k in keys])


def probe_round(t: TieredTier) -> list[FsJob]:
    """A step ends and its probes come back before the next one."""
    jobs = t.end_step()
    t.files.run_probes()
    return jobs


def test_a_key_missing_from_the_host_is_retry_until_its_probe_is_back():
    """tiering/async_lookup.py AsyncLookupManager.lookup, flush, drain_results, and
    tiering/manager.py TieringOffloadingManager.lookup (RETRY, then a promotion: HIT_PENDING)."""
    t = TieredTier(4, files=FileTier({5}))
    assert [look(t, "A", 5), look(t, "A", 5)] == [RETRY, RETRY]
    assert t.files.probe_state() == {5: (0, None, frozenset({"A"}))}
    assert t.end_step() == []  # posts the probe
    assert look(t, "A", 5) == RETRY  # posted, not back; this lookup was the step's one drain
    t.files.run_probes()
    assert look(t, "A", 5) == RETRY  # back, but only a flush or the next step's lookup applies it
    assert t.files.probe_state()[5][0] == IN_FLIGHT
    t.end_step()
    assert t.files.probe_state()[5][0] == RESOLVED
    assert look(t, "A", 5) == PENDING
    assert t.resident() == {5: 0} and t.num_promoted == 1
    assert look(t, "A", 5) == PENDING  # the host answers now
    (job,) = t.end_step()
    assert (job.job_id, job.promotion, job.req, job.keys, job.slots) == (0, True, "A", [5], [0])


def test_a_finished_promotion_is_an_ordinary_host_hit_at_the_next_poll():
    """tiering/manager.py _process_finished_jobs and _complete_promotion (complete_write)."""
    t = TieredTier(4, files=FileTier({5}))
    look(t, "A", 5)
    probe_round(t)
    look(t, "A", 5)
    (job,) = t.end_step()
    t.files.finish(job.job_id)
    assert t.has_pending_work()  # finished, not yet polled
    assert look(t, "A", 5) == HIT
    assert not t.has_pending_work()
    assert t.prepare_load("A", [5], [16]) == [0]
    assert t.files.num_read == 1


def test_promotions_are_one_job_per_request_in_first_promotion_order():
    """tiering/manager.py _initiate_promotion (a slot at lookup) and _flush_pending_promotions
    (one job per request, at the end of the step; ids shared with cascades)."""
    t = TieredTier(6, files=FileTier({10, 20, 11}))
    store(t, "W", [30])
    (cascade,) = t.complete_store([30], req="W")
    assert cascade.job_id == 0
    for req, key in [("B", 11), ("A", 10), ("A", 20)]:
        assert look(t, req, key) == RETRY
    probe_round(t)
    assert [look(t, "A", 10), look(t, "B", 11), look(t, "A", 20)] == [PENDING] * 3
    jobs = t.end_step()
    assert [(j.job_id, j.req, j.keys, j.slots) for j in jobs] == [(1, "A", [10, 20], [1, 3]), (2, "B", [11], [2])]


def test_a_probe_verdict_is_shared_and_kept_until_every_asker_is_finalized():
    """tiering/async_lookup.py AsyncLookupManager.lookup (one state per key) and cleanup: a file
    written after the probe stays a MISS while any request that asked is alive."""
    t = TieredTier(4, files=FileTier())
    look(t, "A", 7)
    probe_round(t)
    assert look(t, "A", 7) == MISS
    t.files.files.add(7)  # written meanwhile (another engine on the same root_dir)
    assert look(t, "C", 7) == MISS
    t.request_finished("A")
    assert look(t, "C", 7) == MISS
    t.request_finished("C")
    assert t.files.probe_state() == {}
    assert look(t, "D", 7) == RETRY
    probe_round(t)
    assert look(t, "D", 7) == PENDING


def test_a_probe_in_flight_outlives_its_requests_and_its_verdict_is_dropped():
    """tiering/async_lookup.py cleanup (keeps IN_FLIGHT states) and drain_results (drops a
    verdict no request wants)."""
    t = TieredTier(4, files=FileTier({3}))
    look(t, "A", 3)
    t.end_step()
    t.request_finished("A")
    assert t.files.probe_state() == {3: (IN_FLIGHT, None, frozenset())}
    t.files.run_probes()
    t.end_step()  # flush drains
    assert t.files.probe_state() == {}
    look(t, "B", 4)  # a queued probe of a finished request is simply forgotten
    t.request_finished("B")
    assert (t.files.probe_state(), t.end_step()) == ({}, [])


def test_a_request_keeps_its_probes_until_its_stores_to_the_host_complete():
    """tiering/manager.py on_request_finished and _maybe_finalize_request."""
    t = TieredTier(4, files=FileTier())
    look(t, "A", 1)
    store(t, "A", [1])
    t.request_finished("A")
    assert t.files.probe_state() == {1: (0, None, frozenset({"A"}))}
    t.complete_store([1], req="A")
    assert t.files.probe_state() == {}
    with pytest.raises(ValueError, match="no store to the host in flight"):
        t.complete_store([1], req="A")


def test_a_completed_store_cascades_and_pins_its_slots_until_polled():
    """tiering/manager.py complete_store and create_store_job (prepare_read pins without a
    request access), and prepare_store (polls finished jobs before evicting)."""
    t = TieredTier(2, files=FileTier())
    assert store(t, "A", [1, 2]) == StoreOutput([1, 2], [0, 1], [])
    (job,) = t.complete_store([1, 2], req="A")
    assert (job.job_id, job.promotion, job.keys, job.slots) == (0, False, [1, 2], [0, 1])
    assert (t.host.num_evictable, t.num_cascaded) == (0, 2)
    assert store(t, "B", [3]) is None  # both pinned by the cascade
    t.files.finish(0)
    assert t.files.files == {1, 2}
    assert store(t, "B", [3]) == StoreOutput([3], [0], [1])  # the poll unpinned them first
    assert t.num_alloc_failures == 1


def test_a_failed_store_to_the_host_is_not_cascaded():
    """tiering/manager.py complete_store (cascades only on success)."""
    t = TieredTier(2, files=FileTier())
    store(t, "A", [1])
    assert t.complete_store([1], False, req="A") == []
    assert (t.resident(), t.jobs()) == ({}, {})


def test_a_cascade_writes_new_files_in_order_up_to_a_failure():
    """tiering/fs/io.py batch_store_block and _store_block (an existing file is kept)."""
    f = FileTier({2})
    f.submit(FsJob(0, False, "A", [1, 2, 3], [0, 1, 2]))
    f.finish(0, fail_at=2)
    f.submit(FsJob(1, False, "A", [2, 4], [1, 3]))
    f.finish(1)
    assert (f.files, f.num_written) == ({1, 2, 4}, 2)
    assert f.get_finished_jobs() == [FsResult(0, False, (1, 2)), FsResult(1, True)]


def test_a_promotion_cut_by_a_short_read_keeps_its_prefix():
    """tiering/fs/io.py _load_block (a short read deletes the file), fs/manager.py
    get_finished_jobs (mark_miss on the unread keys) and tiering/manager.py _complete_promotion
    (and get_load_source: the read keys stay disk hits)."""
    t = TieredTier(4, files=FileTier({10, 20, 30}))
    for key in (10, 20, 30):
        look(t, "A", key)
    probe_round(t)
    assert [look(t, "A", k) for k in (10, 20, 30)] == [PENDING] * 3
    (job,) = t.end_step()
    assert [t.from_files("A", k) for k in (10, 20, 30)] == [True] * 3
    t.files.finish(job.job_id, fail_at=1, short_read=True)
    assert t.files.files == {10, 30}
    assert [look(t, "A", k) for k in (10, 20, 30)] == [HIT, MISS, MISS]
    assert t.resident() == {10: 0}
    assert t.files.probe_state() == {k: (RESOLVED, k == 10, frozenset({"A"})) for k in (10, 20, 30)}
    assert t.host.num_free == 3
    assert [t.from_files("A", k) for k in (10, 20, 30)] == [True, False, False]  # get_load_source
    t.request_finished("A")
    assert not t.from_files("A", 10)


def test_a_promotion_stops_at_a_missing_file():
    """tiering/fs/io.py batch_load_block (raises at the first failing block, num_succeeded)."""
    f = FileTier({1})
    f.submit(FsJob(0, True, "A", [1, 2], [0, 1]), now=0.0)
    f.finish(0)
    assert f.get_finished_jobs() == [FsResult(0, False, (1,))]
    assert f.files == {1}


def test_a_file_hit_with_no_host_room_is_a_miss():
    """tiering/manager.py _initiate_promotion (prepare_write None: a MISS, not a retry)."""
    t = TieredTier(1, files=FileTier({9}))
    store(t, "A", [1])  # pending: not evictable
    look(t, "B", 9)
    probe_round(t)
    assert look(t, "B", 9) == MISS
    assert (t.num_promotion_failures, t.num_alloc_failures, t.host.num_alloc_failures) == (1, 0, 1)


def test_a_promoted_chunk_is_the_requests_insertion_not_its_reuse():
    """tiering/manager.py _initiate_promotion (prepare_write under the request's context) and
    cpu/manager.py _record_request_cache_access (re-reading an insertion is no reuse)."""
    t = TieredTier(4, "arc", files=FileTier({1}))
    look(t, "A", 1)
    probe_round(t)
    look(t, "A", 1)
    (job,) = t.end_step()
    t.files.finish(job.job_id)
    assert look(t, "A", 1) == HIT
    t.prepare_load("A", [1], [16])
    t.complete_load([1])
    t.request_finished("A")
    arc = t.host.policy
    assert isinstance(arc, HostARC)
    assert (list(arc.t1), list(arc.t2)) == ([1], [])
    t.prepare_load("B", [1], [16])
    t.request_finished("B")
    assert (list(arc.t1), list(arc.t2)) == ([], [1])


def test_reset_drains_jobs_keeps_files_and_holds_promotions():
    """tiering/manager.py reset_cache (drain_jobs, the files and verdicts stay, promotions held)
    and on_reset_flushed."""
    t = TieredTier(4, files=FileTier({5}))
    store(t, "A", [1])
    t.complete_store([1], req="A")
    look(t, "B", 5)
    probe_round(t)
    look(t, "B", 5)  # promotion queued, not submitted
    t.reset()
    assert (t.resident(), t.jobs(), t.files.files) == ({}, {}, {1, 5})
    assert t.files.probe_state() == {5: (RESOLVED, True, frozenset({"B"}))}
    assert look(t, "B", 5) == MISS  # held
    t.reset_flushed()
    assert look(t, "B", 5) == PENDING
    assert [(j.job_id, j.keys, j.slots) for j in t.end_step()] == [(1, [5], [0])]


def test_store_threshold_is_refused():
    """tiering/spec.py TieringOffloadingSpec.get_manager."""
    with pytest.raises(ValueError, match="store_threshold 2"):
        TieredTier(4, store_threshold=2)


def test_the_pool_serves_its_own_queue_first():
    """tiering/fs/thread_pool.py DualQueueThreadPool._worker: read threads take loads first,
    write threads stores first, either takes the other queue when its own is empty."""
    pool = IOPool(1, 1, seconds_per_read=1.0, seconds_per_write=2.0)
    s1, s2 = FsJob(0, False, "A", [1, 2], [0, 1]), FsJob(1, False, "A", [3], [2])
    load = FsJob(2, True, "B", [4], [3], submitted_at=0.5)
    for job in (s1, s2, load):
        pool.submit(job)
    pool.schedule(1.9)
    assert (s1.done_at, s2.done_at, load.done_at) == (4.0, 2.0, float("inf"))
    pool.schedule(2.0)
    assert load.done_at == 3.0
    l2, s3 = FsJob(3, True, "B", [5], [4], submitted_at=5.0), FsJob(4, False, "B", [6], [5], submitted_at=5.0)
    pool.submit(s3)
    pool.submit(l2)
    pool.schedule(5.0)
    assert (l2.done_at, s3.done_at) == (6.0, 7.0)
    with pytest.raises(ValueError, match="at least one I/O thread"):
        IOPool(0, 0)


def test_advance_runs_jobs_and_probes_in_time_order():
    """Time as explicit calls: a file written before a probe runs is seen by it
    (the probe thread and the pool of tiering/fs/manager.py run beside the scheduler)."""
    f = FileTier(pool=IOPool(1, 1, seconds_per_write=0.5), seconds_per_probe=1.0)
    t = TieredTier(4, files=f)
    assert look(t, "A", 8) == RETRY
    t.end_step(now=0.0)  # probe done at 1.0
    store(t, "W", [8])
    (job,) = t.complete_store([8], req="W", now=0.2)
    assert t.next_event() == 0.2  # the cascade starts
    t.advance(0.2)
    assert (job.done_at, t.next_event()) == (0.7, 0.7)
    t.advance(1.0)
    assert f.files == {8} and f.get_finished_jobs() == [FsResult(job.job_id, True)]
    t.end_step(now=1.0)
    assert f.probe_state()[8] == (RESOLVED, True, frozenset({"A"}))
    assert t.next_event() is None
