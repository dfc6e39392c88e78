"""What one scheduler step is made of: the sequences in flight (`Live`) and the batch they form."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvsim.kvcache.sequence import Sequence
from kvsim.workloads.request import Request


class Live:
    """One sequence in flight: the request it answers, its KV sequence, and its final length."""

    __slots__ = ("req", "row", "seq", "target", "order", "since", "wake", "keys", "parent", "admitted", "prefilling",
                 "arrival", "ph", "inflight", "stale", "fin", "limit", "last_seq", "uid")

    def __init__(self, req: Request, row: int, max_len: int | None = None):
        self.req = req
        self.parent: Request | None = None  # the request with n > 1 this sample fanned out from
        self.admitted = False  # admitted once already (its prompt and hit are counted then)
        self.arrival = req.arrival  # when it reached the engine (set by `Scheduler.add`): priority's tie-break
        self.row = row  # the request's row in the RequestLog (arrival order; shared by its samples)
        self.seq: Sequence | None = None  # made (prompt materialised) at first admission
        self.uid = 0  # its sequence's uid (`Scheduler.add`: by arrival, whatever the admission order)
        self.keys: tuple[list[int], int] | None = None  # its prompt's block keys, hashed ahead (WaitQueue.hash_ahead)
        self.target = req.prompt_len + max(req.output_len, 1)  # tokens when done
        if max_len is not None and self.target > max_len:
            self.target = max_len  # vLLM stops the sequence at max_model_len
        self.order = -1  # sort key of its place in RUNNING (when it joined); -1: not running
        self.prefilling = False  # its last chunk left prompt to compute (vLLM is_prefill_chunk; cadence only)
        # vLLM's output counters: non-zero only with async output (sim.engine.scheduler.AsyncOutput)
        self.ph = 0  # num_output_placeholders: sampled tokens in flight
        self.inflight = 0  # num_in_flight_tokens: scheduled tokens whose batch is not applied
        self.stale = 0  # num_stale_output_tokens: in-flight tokens from before a preemption
        self.fin = False  # finished or dropped: later outputs are ignored
        self.limit = req.prompt_len + max(req.output_len, 1)  # prompt + max_tokens
        self.last_seq = 0  # vLLM last_sched_seq: the fence of the last step that scheduled it (deferred frees)
        # NOTE: kept by sim.engine.shortcuts (lazy decodes), nowhere else
        self.since = -1  # decoding lazily since this step; -1: not
        self.wake = 0  # the step at which lazy decoding ends


@dataclass(slots=True)
class Batch:
    """What one step computes: sequences with their new-token counts, and the step's totals."""

    lives: list[Live] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    decodes: list[Live] = field(default_factory=list)  # in-place decodes, applied when scheduled
    finishing: list[Live] = field(default_factory=list)  # of those, the ones that sampled their last token
    frag: int = 0  # internal fragmentation of the other in-place decodes
    prefill_tokens: int = 0
    chunks: list[tuple[int, int]] = field(default_factory=list)  # each prefill chunk's (prior, new tokens)
    decode_tokens: int = 0
    context_tokens: int = 0  # sum of scheduled sequences' lengths after the step
    preempted_recompute: int = 0
    preempted_swap: int = 0
    admitted: int = 0  # requests admitted for the first time
    admitted_prompt_tokens: int = 0
    admitted_hit_tokens: int = 0

    lazy: int = 0  # lazy decodes (see sim.engine.shortcuts)
    start: float = 0.0  # when it was scheduled (and starts to run)
    k: int = 0  # the scheduler's step number for it (`Scheduler.steps_scheduled`)
    sampled: list[bool] = field(default_factory=list)  # async output: per sequence, whether it samples a token

    @property
    def num_seqs(self) -> int:
        return len(self.lives) + len(self.decodes) + self.lazy
