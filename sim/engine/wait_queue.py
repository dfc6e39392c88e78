"""The WAITING queue: FCFS or priority order, with front insertion for recompute-preempted requests."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from itertools import islice

from kvsim.kvcache.hashing import prefix_keys
from kvsim.sim.engine.batch import Live

AHEAD = 64  # prompts hashed in one batch


class WaitQueue:
    """WAITING requests: FCFS (a deque) or by (priority, arrival, id) (a heap), the order of
    vllm/v1/request.py `Request.__lt__`; the arrival is when the request reached the engine
    (`Live.arrival`: vLLM's front end stamps `arrival_time` on receipt, so a closed-loop session's
    turn counts from its release)."""

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
            heapq.heappush(self._q, (r.priority, live.arrival, r.id, next(self._tie), live))
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

    def hash_ahead(self, live: Live, block_size: int) -> None:
        """Give `live`, and the lives next in line not yet hashed, their prompts' block keys
        (`Live.keys`) in one batch: hashing many prompts at once costs about what one costs."""
        ahead = self._q if not self.priority else (e[-1] for e in self._q)  # a heap: near the front
        batch = [live, *(x for x in islice(ahead, AHEAD) if x.keys is None and x.seq is None and x is not live)]
        todo = []  # those to hash, each with where it keeps its keys for its other copy (a P/D request's)
        for x in batch:
            memo, slot = x.req.keys_memo, None
            if memo is not None:
                p = x.req.prompt
                key = (block_size, len(p) // block_size, p.__array_interface__["data"][0])
                hit = memo.pop(key, None)  # (the other copy's, taken once: its list is this one's now)
                if hit is not None:
                    x.keys = hit
                    continue
                slot = (memo, key)
            todo.append((x, slot))
        if not todo:
            return
        for (x, slot), keys in zip(todo, prefix_keys([x.req.prompt for x, _ in todo], block_size), strict=True):
            x.keys = keys
            if slot is not None:  # (a copy kept for the other: the sequence extends its own list)
                memo, key = slot
                memo[key] = (list(keys[0]), keys[1])
