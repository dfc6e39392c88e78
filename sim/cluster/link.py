"""The network between a P/D cluster's replicas: KV reads sharing their replicas' NICs fairly.

Each replica has one NIC a rank (its ranks read their own shares in parallel, so a transfer's bytes
are one rank's and a NIC's bandwidth is one rank's, `gbps`). A read moves its bytes from the prefill
replica's NIC to the decode replica's; when the pools' TP sizes differ, the two ends' ranks carry
different bytes of it (`sim.engine.nixl_tp`), so a read counts its progress in the sending rank's
bytes and puts `dst_per_src` bytes through the receiving NIC for each. Concurrent reads through a NIC
share it max-min fairly in that progress (progressive filling: every unfixed read through the NIC
whose equal share is smallest gets that share, the others take what is left; with equal TP sizes,
equal bytes), recomputed whenever a read starts or ends, so a read's end moves as others come and go. A read ends `latency_s` after its last byte (BLIS models a transfer as a base latency
plus bytes over bandwidth; with one read at a time this is exactly `KVTransfer.seconds`).

Exactness over floats: completion times are computed event by event (the next read to drain at
the current rates), never by stepping a clock; `advance(t)` settles every end at or before `t`, so a
replica polling at `t` after every start before `t` is known sees final answers (`sim.cluster`'s
engines run in time order: `sim.cluster.cluster`'s module docstring).
"""

from __future__ import annotations

from dataclasses import dataclass

_EPS_BYTES = 1e-6  # a read with less left than this has drained (float residue of the rate sums)


@dataclass(slots=True)
class _Read:
    src: int
    dst: int
    left: float  # bytes still to move (the sending rank's)
    dst_per_src: float = 1.0  # the receiving rank's bytes for each byte sent
    rate: float = 0.0  # bytes a second now (the sending rank's)
    drained: float | None = None  # when its last byte moved


class SharedLink:
    """Reads between replicas over their NICs, each `gbps` GB/s, shared max-min fairly."""

    def __init__(self, gbps: float, latency_s: float):
        if not gbps > 0:
            raise ValueError(f"gbps must be positive, got {gbps}")
        self.bps = gbps * 1e9
        self.latency_s = latency_s
        self._active: dict[object, _Read] = {}
        self._done: dict[object, float] = {}  # read -> when it ends (drained + latency)
        self._time = 0.0  # the last event (a start or an end): the reads' bytes left are as of then
        self._seen = 0.0  # the latest time anyone asked about: no read may start before it

    def start(self, key: object, src: int, dst: int, nbytes: float, at: float, dst_per_src: float = 1.0) -> None:
        """A read of `nbytes` (a sending rank's) from replica `src` to `dst` starts at `at` (not before
        the last start); a receiving rank takes `dst_per_src` bytes for each byte sent."""
        if key in self._active or key in self._done:
            raise ValueError(f"read {key!r} started twice")
        if at < self._seen:  # the link was asked past `at` already: the reads' shares since then would be wrong
            raise RuntimeError(f"read {key!r} starts at {at!r}, before the link's time {self._seen!r}")
        self.advance(at)
        self._move(at - self._time)  # a start is an event: the reads in flight move on to it
        self._time = at
        if nbytes <= 0:
            self._done[key] = at + self.latency_s
            return
        if not dst_per_src > 0:
            raise ValueError(f"read {key!r}: dst_per_src must be positive, got {dst_per_src}")
        self._active[key] = _Read(src, dst, float(nbytes), float(dst_per_src))
        self._rates()

    def advance(self, t: float) -> None:
        """Settle every read that drains by `t`, in order (the rest speed up at each end). The reads
        move only from event to event (a start, an end), never to `t` itself: the ends depend on the
        starts alone, not on when anyone looked (floats summed in one order)."""
        self._seen = max(self._seen, t)
        while self._active:
            key, r = min(((k, r) for k, r in self._active.items() if r.rate > 0),
                         key=lambda kr: kr[1].left / kr[1].rate)
            dt = r.left / r.rate
            if self._time + dt > t:
                break
            self._move(dt)
            self._time += dt
            for k in [k for k, x in self._active.items() if x.left <= _EPS_BYTES]:
                self._done[k] = self._time + self.latency_s
                del self._active[k]
            self._rates()

    def done_at(self, key: object) -> float | None:
        """When read `key` ends, if settled (its last byte moved by the last `advance`); else None."""
        return self._done.get(key)

    def eta(self, key: object) -> float:
        """When read `key` ends: settled, or as things stand (its bytes left at its current rate)."""
        done = self._done.get(key)
        if done is not None:
            return done
        r = self._active[key]
        return self._time + r.left / r.rate + self.latency_s

    def next_end(self) -> float | None:
        """When the next read in flight would end at the current rates (None: none in flight)."""
        ends = [self._time + r.left / r.rate + self.latency_s for r in self._active.values() if r.rate > 0]
        settled = [t for t in self._done.values() if t > self._seen]
        return min(ends + settled, default=None)

    def forget(self, key: object) -> None:
        """Drop a settled read's record (its reader has seen it)."""
        self._done.pop(key, None)

    def _move(self, dt: float) -> None:
        for r in self._active.values():
            r.left -= r.rate * dt

    def _rates(self) -> None:
        """Max-min fair rates by progressive filling: the NIC with the smallest equal share (its bytes
        left over the unfixed reads' bytes per byte sent through it) fixes the rate of every unfixed
        read through it; repeat with what is left."""
        reads = list(self._active.values())
        for r in reads:
            r.rate = 0.0
        cap: dict[tuple[str, int], float] = {}
        users: dict[tuple[str, int], list[tuple[_Read, float]]] = {}
        for r in reads:
            for nic, weight in ((("out", r.src), 1.0), (("in", r.dst), r.dst_per_src)):
                cap.setdefault(nic, self.bps)
                users.setdefault(nic, []).append((r, weight))
        fixed: set[int] = set()
        while len(fixed) < len(reads):
            share, nic = min(((cap[n] / sum(w for r, w in rs if id(r) not in fixed), n)
                              for n, rs in users.items() if any(id(r) not in fixed for r, _ in rs)),
                             key=lambda sn: (sn[0], sn[1]))
            for r, _ in users[nic]:
                if id(r) in fixed:
                    continue
                r.rate = share
                fixed.add(id(r))
                cap[("out", r.src)] -= share
                cap[("in", r.dst)] -= share * r.dst_per_src
