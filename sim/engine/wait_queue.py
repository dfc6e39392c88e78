"""The WAITING queue: FCFS or priority order, with front insertion for recompute-preempted requests."""

from __future__ import annotations

import heapq
import itertools
from collections import deque

from sim.engine.batch import Live


class WaitQueue:
    """WAITING requests: FCFS (a deque) or by (priority, arrival, id) (a heap), the order of
    vllm/v1/request.py `Request.__lt__`."""

    def __init__(self, priority: bool):
        self.priority = priority
        self._q: deque[Live] | list[tuple] = [] if priority else deque()
        self._tie = itertools.count()  # forked samples share a row: keep heap keys unique

    def __len__(self) -> int:
        return len(self._q)

    def push(self, live: Live, front: bool = False) -> None:
        """Queue at the back (new) or the front (recompute-preempted); priority mode ignores `front`."""
        if self.priority:
            r = live.req
            heapq.heappush(self._q, (r.priority, r.arrival, r.id, next(self._tie), live))
        elif front:
            self._q.appendleft(live)
        else:
            self._q.append(live)

    def peek(self) -> Live:
        return self._q[0][-1] if self.priority else self._q[0]

    def pop(self) -> Live:
        return heapq.heappop(self._q)[-1] if self.priority else self._q.popleft()

    def remove(self, live: Live) -> None:
        """Take `live` out wherever it is (vLLM's `RequestQueue.remove_request`)."""
        if self.priority:
            self._q = [e for e in self._q if e[-1] is not live]
            heapq.heapify(self._q)
        else:
            self._q.remove(live)
