"""The engine's front end: requests reach it at their arrival times, or, in closed-loop
sessions, `think_time` after the session's previous turn is done.

One SimPy process streams the workload (`Frontend`); `Sessions` holds back a session's later
turns. Both kvsim's engine (`sim.engine.loop.Engine`) and the cost-clock conformance driver
over vLLM's own scheduler (`sim.conform.vllm_timed`) take their requests from it, so both sides
of `kvsim conform` see each request at the same simulated time.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator

import simpy

from kvsim.workloads.request import Request


class Sessions:
    """Closed-loop multi-turn sessions: turn i is released `think_time` after turn i-1 is done."""

    def __init__(self, env: simpy.Environment, release: Callable[[Request], None]):
        self.env = env
        self.release = release
        self.last_done: dict[str, float | None] = {}  # session -> when its last turn was done; None: in flight
        self.held: dict[str, deque[Request]] = {}  # turns whose previous turn is still in flight
        self.outstanding = 0  # turns held or on a timer

    def arrive(self, req: Request) -> None:
        """A turn reached its open-loop arrival time in the stream."""
        sid = req.session
        if req.think_time is None or sid not in self.last_done:  # a first turn
            self.last_done[sid] = None
            self.release(req)
            return
        last = self.last_done[sid]
        if last is None:
            self.held.setdefault(sid, deque()).append(req)
            self.outstanding += 1
        else:
            self.last_done[sid] = None
            self._at(max(self.env.now, last + req.think_time), req)

    def done(self, req: Request, now: float) -> None:
        """A turn finished (or was dropped) at `now`: release the session's next turn, if held."""
        sid = req.session
        if sid not in self.last_done:
            return
        q = self.held.get(sid)
        if q:
            nxt = q.popleft()
            if not q:
                del self.held[sid]
            self.outstanding -= 1
            self._at(now + (nxt.think_time or 0.0), nxt)
        else:
            self.last_done[sid] = now

    def _at(self, t: float, req: Request) -> None:
        self.outstanding += 1

        def fire(_: simpy.Event) -> None:
            self.outstanding -= 1
            self.release(req)

        self.env.timeout(t - self.env.now).callbacks.append(fire)


class Frontend:
    """The arrivals process: hands each request to `admit` at its time (arrival / `load`, or its
    session's release), and wakes a step process that sleeps on `wait()`."""

    def __init__(self, env: simpy.Environment, workload: Iterable[Request], admit: Callable[[Request], None], *,
                 load: float = 1.0, closed_loop: bool = False):
        self.env = env
        self.admit = admit
        self.load = load
        self.sessions = Sessions(env, self._release) if closed_loop else None
        self.source_done = False
        self._wake: simpy.Event | None = None
        env.process(self._arrivals(iter(workload)))

    def _arrivals(self, stream: Iterator[Request]):
        env, sessions, load = self.env, self.sessions, self.load
        for req in stream:
            delay = req.arrival / load - env.now
            if delay > 0:
                yield env.timeout(delay)
            if sessions is not None and req.session is not None:
                sessions.arrive(req)
            else:
                self._release(req)
        self.source_done = True
        self._poke()

    def _release(self, req: Request) -> None:
        """The request reaches the engine now."""
        self.admit(req)
        self._poke()

    def _poke(self) -> None:
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    def done(self, req: Request, now: float) -> None:
        """`req` finished or was dropped at `now` (its session's next turn may follow)."""
        if self.sessions is not None and req.session is not None:
            self.sessions.done(req, now)

    def idle(self) -> bool:
        """No request will ever arrive again: the stream is over and no session turn is pending."""
        return self.source_done and (self.sessions is None or self.sessions.outstanding == 0)

    def upto(self, t: float):
        """Let every event at or before `t` happen (arrivals, session releases) before the caller
        goes on at `t` (a SimPy generator: `yield from`)."""
        env = self.env
        while env.peek() <= t:
            yield env.timeout(max(t - env.now, 0.0))

    def idle_wait(self, t0: float, until: float):
        """An empty step at `t0` whose connector's next transfer is due at `until` (> t0): go on at
        `until`, or at the next event before it (an arrival may bring work); returns the clock."""
        clock = min(until, max(self.env.peek(), t0))
        yield from self.upto(clock)
        return clock

    def wait(self):
        """Sleep until the next request reaches the engine (a SimPy generator: `yield from`)."""
        self._wake = self.env.event()
        yield self._wake
        self._wake = None
