"""The P/D cluster's network (sim/cluster/link.py): reads sharing NICs max-min fairly, hand-worked.

With one read at a time a read takes BLIS's transfer time, base latency plus bytes over bandwidth
(inference-sim's KV transfer model); concurrent reads share a NIC (issue 39: "the link shared by
concurrent transfers per NIC (fair share)")."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsim.sim.cluster.link import SharedLink
from kvsim.sim.engine.nixl import BlockBytes, KVTransfer

GB = 1e9


def test_one_read_takes_latency_plus_bytes_over_bandwidth():
    link = SharedLink(gbps=25.0, latency_s=5e-5)
    link.start("a", 0, 1, 7 * 2**21, at=1.0)
    assert link.done_at("a") is None  # not settled yet
    assert link.next_end() == pytest.approx(1.0 + KVTransfer(BlockBytes(2**21)).seconds(7), rel=1e-12)
    link.advance(2.0)
    assert link.done_at("a") == pytest.approx(1.0 + KVTransfer(BlockBytes(2**21)).seconds(7), rel=1e-12)


def test_two_reads_from_one_prefill_nic_share_it():
    link = SharedLink(gbps=1.0, latency_s=0.0)
    link.start("a", 0, 1, GB, at=0.0)
    link.start("b", 0, 2, GB, at=0.0)
    link.advance(10.0)
    assert (link.done_at("a"), link.done_at("b")) == (2.0, 2.0)


def test_a_read_slows_when_another_joins_and_speeds_up_when_it_leaves():
    link = SharedLink(gbps=1.0, latency_s=0.25)
    link.start("a", 0, 1, GB, at=0.0)  # alone until 0.5: half its bytes move
    link.start("b", 2, 1, GB, at=0.5)  # shares the decode NIC: each at 0.5 GB/s
    link.advance(10.0)
    # a: 0.5 GB left at 0.5 GB/s -> drained at 1.5; b: 0.5 GB moved by 1.5, the rest alone -> 2.0
    assert link.done_at("a") == pytest.approx(1.5 + 0.25, rel=1e-12)
    assert link.done_at("b") == pytest.approx(2.0 + 0.25, rel=1e-12)


def test_max_min_fair_rates_across_nics():
    # P0->D0, P0->D1, P1->D1: the NICs of P0 and D1 each carry two reads, so every read gets half;
    # when P0->D0 ends... all three drain together
    link = SharedLink(gbps=1.0, latency_s=0.0)
    for key, src, dst in (("x", 0, 10), ("y", 0, 11), ("z", 1, 11)):
        link.start(key, src, dst, GB, at=0.0)
    link.advance(5.0)
    assert [link.done_at(k) for k in "xyz"] == [2.0, 2.0, 2.0]
    # one bottleneck, one free read: P0->D0 (1 GB) and P1->D1 (1 GB) share nothing
    link2 = SharedLink(gbps=1.0, latency_s=0.0)
    link2.start("u", 0, 10, GB, at=0.0)
    link2.start("v", 1, 11, GB, at=0.0)
    link2.start("w", 0, 12, 3 * GB, at=0.0)  # shares P0's NIC with u
    link2.advance(10.0)
    # u and w at 0.5 until u drains at 2; then w alone: 2 GB left at 1 GB/s -> 4
    assert (link2.done_at("u"), link2.done_at("v"), link2.done_at("w")) == (2.0, 1.0, 4.0)


def test_a_read_started_twice_is_refused():
    link = SharedLink(gbps=1.0, latency_s=0.0)
    link.start("a", 0, 1, GB, at=0.0)
    with pytest.raises(ValueError, match="started twice"):
        link.start("a", 0, 1, GB, at=0.1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(3, 5), st.integers(1, 50), st.integers(0, 20)),
                min_size=1, max_size=8))
def test_bytes_are_conserved_and_no_nic_is_oversubscribed(reads):
    """Every read ends no earlier than alone on the link would take it, and the NIC of each end
    moves at most its bandwidth: the bytes through a NIC over any read's lifetime fit in it."""
    link = SharedLink(gbps=1.0, latency_s=0.0)
    t = 0.0
    starts = {}
    for i, (src, dst, size, gap) in enumerate(reads):
        t += gap / 10
        link.start(i, src, dst, size * 1e8, at=t)
        starts[i] = (t, src, dst, size * 1e8)
    link.advance(1e6)
    for i, (t0, _src, _dst, nbytes) in starts.items():
        assert link.done_at(i) >= t0 + nbytes / GB - 1e-9
    for nic_of in (lambda s: s[1], lambda s: s[2]):  # each sender's NIC, then each receiver's
        for nic in {nic_of(s) for s in starts.values()}:
            mine = [(s[0], link.done_at(i), s[3]) for i, s in starts.items() if nic_of(s) == nic]
            first, last = min(m[0] for m in mine), max(m[1] for m in mine)
            assert sum(m[2] for m in mine) <= (last - first) * GB + 1e-3


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(3, 5), st.integers(1, 50), st.integers(0, 20)),
                min_size=1, max_size=8),
       st.lists(st.floats(0.0, 10.0), max_size=12))
def test_ends_do_not_depend_on_when_anyone_looks(reads, looks):
    """The reads move from event to event only, so polling the link at other times (as replicas do,
    more or less often with the speed shortcuts on or off) changes no end, to the last bit."""
    quiet, busy = SharedLink(gbps=25.0, latency_s=5e-5), SharedLink(gbps=25.0, latency_s=5e-5)
    t = 0.0
    pending = sorted(x / 100 for x in looks)
    for i, (src, dst, size, gap) in enumerate(reads):
        t += gap / 1000
        while pending and pending[0] <= t:
            busy.advance(pending.pop(0))
        quiet.start(i, src, dst, size * 7 * 2**21, at=t)  # blocks of 2 MiB, a rank's
        busy.start(i, src, dst, size * 7 * 2**21, at=t)
    quiet.advance(1e6)
    busy.advance(1e6)
    assert [quiet.done_at(i) for i in range(len(reads))] == [busy.done_at(i) for i in range(len(reads))]
