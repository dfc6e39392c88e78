"""vLLM 0.33's local prefill cadence (`prefill_schedule_interval`): prefill held for N executed steps.

vllm/v1/core/sched/scheduler.py (0.33) `Scheduler.__init__` (local_prefill_interval, set where data
parallelism is off) and `Scheduler.schedule`: a step is held when the interval is above 1, the last
release was not capacity-bound, fewer than N executed steps (steps that scheduled tokens) separate this
one from the last step that carried prefill, and some running request decodes (is not mid-prefill).
A held step skips running requests mid-prefill and stops the WAITING scan at the first request with
prompt left to compute (hit < tokens - 1); a request whose KV is loaded from the host tier still starts
its load. A step that is not held records whether it was capacity-bound: requests still wait, beyond
those the scan skipped (vLLM's `deferred_waiting`: skipped until admitted or done). Any step whose
running requests were mid-prefill, or that admitted one with prompt left, restarts the interval.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvsim.sim.engine.batch import Live


class PrefillCadence:
    """One scheduler's cadence state (vLLM's num_executed_steps, last_prefill_step, prefill_capacity_bound)."""

    def __init__(self, interval: int):
        self.interval = interval
        self.executed = 0  # steps that scheduled tokens
        self.last = -interval  # the executed step that last carried prefill (a full interval back: none held first)
        self.bound = False  # the last release left requests waiting beyond the skipped ones
        self.deferred: set[Live] = set()  # lives the WAITING scan skipped, until admitted or done

    def holds(self, running: list[Live]) -> bool:
        """Whether the step about to be scheduled holds prefill back."""
        return (not self.bound and self.executed + 1 - self.last < self.interval
                and any(not x.prefilling for x in running))

    def released(self, waiting: int) -> None:
        """A step that did not hold scanned WAITING, which now holds `waiting` requests."""
        self.bound = waiting > len(self.deferred)

    def end(self, scheduled: bool, prefill: bool) -> None:
        """The step scheduled tokens (or not), and carried prefill (or not)."""
        if scheduled:
            self.executed += 1
        if prefill:
            self.last = self.executed
