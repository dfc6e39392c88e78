"""A cluster's KV events as one stream: every replica's step batches (`kvcache.events.EventBatch`,
stamped with its replica), handed at once to the router that reads them and, in one deterministic
order, to the run's own sink (`kvsim run --replicas N --kv-events FILE`).

The order is by simulated time (`ts`, when the step's output was applied), then replica, then
step. Replicas do not send in that order: an engine runs ahead of the SimPy clock while no event
falls before its own clock (`sim.cluster.cluster`), so one replica's batch at t may be sent before
another's at s < t. But no engine's clock is behind the SimPy clock when it applies a step's
output, so once the clock has passed t no replica can send a batch at or before t: the stream
holds each batch until then, and memory stays bounded by the batches of the time engines run ahead.
A batch that would break the order is an error, not a silent misordering."""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable

import simpy

from kvsim.kvcache.events import EventBatch

Sink = Callable[[EventBatch], None]


class EventStream:
    """Each replica's KV-event batches: to `router` (a router's `DelayedEvents.send`) as they are
    sent, and to `out` in the order (ts, replica, step) once the clock has passed their time
    (`close` hands on the rest when the run ends)."""

    def __init__(self, env: simpy.Environment, router: Sink | None = None, out: Sink | None = None):
        self.env = env
        self.router = router
        self.out = out
        self._held: list[tuple[tuple[float, int, int], EventBatch]] = []
        self._last: tuple[float, int, int] | None = None  # the key last handed to `out`

    def send(self, batch: EventBatch) -> None:
        """A replica's step produced `batch` (the engines' sink)."""
        if self.router is not None:
            self.router(batch)
        if self.out is None:
            return
        key = (batch.ts, batch.replica, batch.step)
        if self._last is not None and key < self._last:
            raise RuntimeError(f"KV events out of order: replica {batch.replica}'s step {batch.step} at "
                               f"t={batch.ts!r}s came after a batch at t={self._last[0]!r}s was written")
        heapq.heappush(self._held, (key, batch))
        self._release(self.env.now)

    def close(self) -> None:
        """The run ended: hand on every batch still held."""
        self._release(math.inf)

    def _release(self, before: float) -> None:
        held = self._held
        while held and held[0][0][0] < before:
            self._last, batch = heapq.heappop(held)
            self.out(batch)
