"""Each router's picks, worked by hand: tie-breaks, the vLLM balancer's local counts, and staleness
(a router sees engine metrics only as of the latest snapshot)."""

import hashlib

import pytest

from kvsim.sim.cluster.routers import (
    ROUTERS,
    EngineMetrics,
    LeastOutstanding,
    RandomPick,
    RoundRobin,
    RouterView,
    SessionAffinity,
    VllmDP,
    VllmDPLegacy,
)
from kvsim.sim.engine.config import ROUTER_NAMES
from kvsim.workloads.request import make_request


def req(session=None):
    return make_request("r", 0.0, [1, 2, 3, 4], 1, session=session)


def dispatch(router, view, times, session=None):
    """Pick `times` times, counting each pick as the cluster does; the picks."""
    picks = []
    for _ in range(times):
        i = router.pick(req(session), view)
        view.dispatched[i] += 1
        picks.append(i)
    return picks


def snapshot(view, *metrics):
    view.metrics = tuple(EngineMetrics(*m) for m in metrics)
    view.snapshots += 1


def test_every_configured_router_name_has_a_router():
    assert tuple(ROUTERS) == ROUTER_NAMES


def test_round_robin_cycles():
    assert dispatch(RoundRobin(3), RouterView(3), 7) == [0, 1, 2, 0, 1, 2, 0]


def test_random_is_seeded_as_vidurs_randint():
    assert dispatch(RandomPick(3, seed=7), RouterView(3), 8) == [1, 0, 1, 2, 0, 0, 2, 0]
    assert dispatch(RandomPick(3, seed=7), RouterView(3), 8) == [1, 0, 1, 2, 0, 0, 2, 0]
    assert dispatch(RandomPick(3, seed=8), RouterView(3), 8) != [1, 0, 1, 2, 0, 0, 2, 0]


def test_least_outstanding_counts_finishes_and_breaks_ties_low():
    view = RouterView(3)
    lor = LeastOutstanding(3)
    assert dispatch(lor, view, 4) == [0, 1, 2, 0]  # all tied at 0, then 1: lowest index
    view.finished[1] = 1  # outstanding [2, 0, 1]
    assert dispatch(lor, view, 2) == [1, 1]  # [2, 1, 1], then [2, 2, 1]...
    assert view.dispatched == [2, 3, 1]


def test_vllm_dp_rotates_ties_as_round_robin_when_empty():
    # all-zero snapshot: in-flight decides; the scan start rotates, so ties go 0, 1, 2, 0
    assert dispatch(VllmDP(3), RouterView(3), 4) == [0, 1, 2, 0]


def test_vllm_dp_score_with_kv_pressure_and_local_waiting_counts():
    view = RouterView(3)
    snapshot(view, (2, 1, 0.75), (0, 4, 0.9), (1, 2, 1.0))
    dp = VllmDP(3)
    # scores: r0 max(0, 3) + 2 * 6 * 0.25 = 6; r1 4; r2 3 + 1 * 6 * 0.5 = 6 -> r1
    assert dispatch(dp, view, 1) == [1]
    # r1's copy now waits 1: 5 + 6 * 0.4 = 7.4; scan from 1: r1 7.4, r2 6, r0 6 (not < 6) -> r2
    assert dispatch(dp, view, 1) == [2]
    # r2 waits 2: 4 + 2 * 6 * 0.5 = 10; scan from 2: r2 10, r0 6, r1 7.4 -> r0
    assert dispatch(dp, view, 1) == [0]
    assert dp.counts == [[3, 1, 0.75], [1, 4, 0.9], [2, 2, 1.0]]


def test_vllm_dp_keeps_its_copy_until_the_next_snapshot():
    view = RouterView(2)
    snapshot(view, (0, 5, 0.0), (0, 0, 0.0))
    dp = VllmDP(2)
    assert dispatch(dp, view, 3) == [1, 1, 1]  # r1 scores 0, 1, 2 (max of in-flight, local waiting)
    # the engines changed, but no snapshot yet: the router still sees r0 running 5
    assert dispatch(dp, view, 1) == [1]  # r0 5, r1 max(3, 3) = 3
    snapshot(view, (0, 0, 0.0), (0, 9, 0.0))  # the new snapshot replaces the local counts
    assert dispatch(dp, view, 1) == [0]  # r0 0, r1 max(4, 9)
    assert dp.counts == [[1, 0, 0.0], [0, 9, 0.0]]


def test_vllm_dp_legacy_scores_four_waiting_plus_running_from_index_zero():
    view = RouterView(3)
    snapshot(view, (1, 0, 0.0), (0, 3, 0.0), (0, 2, 0.0))
    # 4, 3, 2 -> r2; then 4, 3, 6 -> r1; then 4, 7, 6 -> r0
    assert dispatch(VllmDPLegacy(3), view, 3) == [2, 1, 0]
    # empty: the scan always starts at 0 (no rotation), the local waiting count spreads them
    assert dispatch(VllmDPLegacy(3), RouterView(3), 4) == [0, 1, 2, 0]


def _ring_node(key: str, n: int) -> int:
    """uhashring's lookup written another way: the first point strictly above the key's md5."""
    h = int(hashlib.md5(key.encode()).hexdigest(), 16)
    points = {int(hashlib.md5(f"replica-{i}-{w}".encode()).hexdigest(), 16): i for i in range(n) for w in range(160)}
    above = [p for p in points if p > h]
    return points[min(above) if above else min(points)]


def test_session_affinity_hashes_sessions_on_uhashrings_ring():
    router = SessionAffinity(3)
    keys = ["s0", "s1", "s2", "s3", "s4", "s5", "alice", "bob"]
    # the same nodes as uhashring 2.5's HashRing(nodes=["replica-0", "replica-1", "replica-2"]).get_node
    assert [router.node(k) for k in keys] == [0, 0, 2, 0, 2, 1, 2, 2]
    assert [router.node(k) for k in keys] == [_ring_node(k, 3) for k in keys]
    view = RouterView(3)
    assert dispatch(router, view, 3, session="s5") == [1, 1, 1]
    assert dispatch(router, view, 3) == [0, 2, 0]  # no session: fewest dispatched, lowest index


@pytest.mark.parametrize("name", ROUTER_NAMES)
def test_picks_are_replica_indices(name):
    view = RouterView(4)
    picks = dispatch(ROUTERS[name](4, 0), view, 20, session="x")
    assert all(0 <= p < 4 for p in picks)
