"""Arrivals, mixed into the scheduler: a request joins WAITING, or is dropped at once when it can
never run. A request with n > 1 (parallel sampling) either fans out at arrival into n requests
"{j}_{id}" queued in order, which share the prompt only through the prefix cache (vLLM V1,
vllm/v1/engine/parallel_sampling.py `ParentRequest`), or runs as one sequence whose other
samples fork from it after the prefill, sharing its blocks with copy-on-write (vLLM v0;
`SimConfig.parallel_sampling = "fork"`). Either way its samples share its row in the log,
which closes when the last of them is done.
"""

from __future__ import annotations

from dataclasses import replace

from kvcache.manager import cdiv
from sim.engine.batch import Live
from sim.engine.metrics import REASON_CODE, REJECTED
from workloads.request import Request


def fan_out(req: Request) -> list[Request]:
    """The requests vLLM's front end makes of `req`: itself if n = 1, else n requests "{j}_{id}"
    with n = 1 (vllm/v1/engine/parallel_sampling.py ParentRequest.get_child_info)."""
    return [req] if req.n == 1 else [replace(req, id=f"{j}_{req.id}", n=1) for j in range(req.n)]


class Arrivals:
    """`add` and the fork of a v0-style parallel request (attributes are the scheduler's)."""

    def add(self, req: Request, now: float) -> None:
        """A request arrives: queue it (fanned out if n > 1), or drop it at once if it can never run."""
        row = self.log.add(req.id, now, req.prompt_len, req.output_len, req.n, req.priority)
        reason = self._never_fits(req)
        if reason:
            self.log.status[row] = REJECTED
            self.log.reason[row] = REASON_CODE[reason]
            self.log.finish[row] = now
            self.done.append(req)
            return
        if req.n == 1 or self.fork:
            self.waiting.push(self.live_type(req, row, self.max_len))
            return
        self._open[row] = req.n
        for sample in fan_out(req):
            live = self.live_type(sample, row, self.max_len)
            live.parent = req
            self.waiting.push(live)

    def _never_fits(self, req: Request) -> str:
        if self.max_len is not None and req.prompt_len >= self.max_len:
            return "prompt_exceeds_max_model_len"
        if self.fork and req.n > self.max_active:  # its samples are admitted together
            return "n_exceeds_max_num_seqs"
        if not self.chunked and req.prompt_len > self.max_tokens:
            return "prompt_exceeds_batch"
        if self.m.sliding_window is None and cdiv(req.prompt_len, self.m.block_size) > self.m.num_usable_blocks:
            return "prompt_exceeds_cache"
        return ""

    def _fork(self, live: Live) -> int:
        """v0 parallel sampling: the n - 1 other samples share the prompt's blocks (copy-on-write).
        Returns n, the sequences the request now runs."""
        req = live.req
        self._open[live.row] = req.n
        for j in range(1, req.n):
            child = Live(req, live.row, self.max_len)
            child.admitted = True  # its prompt came with the fork: a later re-admission is not a first one
            child.seq = self.m.fork(live.seq, f"{req.id}/{j}", self._uid)
            self._uid += 1
            self._join(child)
        return req.n
