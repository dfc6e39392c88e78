"""The scheduler's rules on prefill, one object it holds: the long-prefill cap and the local cadence.

The cap (`chunk_cap`): vLLM's `long_prefill_token_threshold` bounds one request's chunk a step; it
is lifted while one request is alone (0.31+) and, adaptive, floored at the token budget over the
requests running and waiting (0.31+); vllm/v1/core/sched/scheduler.py `Scheduler.schedule`.
The cadence (`prefill_schedule_interval`, 0.33): see `sim.engine.cadence`. The scheduler calls
`hold` as a step starts, `released` after a WAITING scan the step did not hold, and `end` when the
step is chosen; while `held` it skips running requests mid-prefill and stops the WAITING scan at
the first request with prompt left to compute. Which rules apply comes from the release profile
of the configured release (`kvcache.profiles`), not from the block manager.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvsim.sim.engine.cadence import PrefillCadence

if TYPE_CHECKING:
    from kvsim.kvcache.profiles import Profile
    from kvsim.sim.engine.batch import Batch, Live
    from kvsim.sim.engine.config import SimConfig


class PrefillRules:
    """The long-prefill cap and the cadence of one scheduler."""

    def __init__(self, cfg: SimConfig, profile: Profile):
        self.long_prefill = cfg.long_prefill_token_threshold
        self.sole_request = profile.long_prefill_sole_request
        self.adaptive = cfg.long_prefill_token_threshold_adaptive
        self.input_tokens = cfg.batch_limits()[0]  # the forward's size: the adaptive cap's floor divides it
        every = cfg.prefill_schedule_interval if profile.local_prefill_cadence else 1
        self.cadence = PrefillCadence(every) if every > 1 else None
        self.held = False  # this step holds prefill back (the cadence)
        self.carried = False  # this step carried prefill: a running request mid-prefill, or an admission

    def chunk_cap(self, eligible: int) -> int:
        """A step's cap on one request's prefill chunk (0: none) with `eligible` requests running or waiting."""
        cap = self.long_prefill
        if not cap or (eligible <= 1 and self.sole_request):
            return 0
        if self.adaptive:
            return max(cap, self.input_tokens // eligible)
        return cap

    # NOTE: these four are called only where there is a cadence (`self.cadence` is not None); `skipped`
    # and `forget` check
    def hold(self, running: list[Live]) -> None:
        """A step starts: whether the cadence holds its prefill back."""
        self.held = self.cadence.holds(running)
        self.carried = False

    def released(self, waiting: int) -> None:
        """The WAITING scan is done (no preemption this step), `waiting` requests left: a step that
        did not hold records whether requests still wait beyond the skipped ones."""
        if not self.held:
            self.cadence.released(waiting)

    def end(self, b: Batch) -> None:
        self.cadence.end(b.num_seqs > 0, self.carried)

    def admitted(self, live: Live, hit: int) -> None:
        """`live` was admitted with `hit` tokens computed: it carries prefill unless only its last token is left."""
        self.cadence.deferred.discard(live)
        if hit < live.seq.num_tokens - 1:
            self.carried = True

    def skipped(self, live: Live) -> None:
        """The WAITING scan skipped `live` (vLLM `skip_request`)."""
        if self.cadence is not None:
            self.cadence.deferred.add(live)

    def forget(self, live: Live) -> None:
        """`live` is done: it no longer counts as skipped."""
        if self.cadence is not None:
            self.cadence.deferred.discard(live)
