"""The scheduler's rules on prefill, mixed into it: the long-prefill cap and the local cadence.

The cap (`chunk_cap`): vLLM's `long_prefill_token_threshold` bounds one request's chunk a step; it
is lifted while one request is alone (0.31+) and, adaptive, floored at the token budget over the
requests running and waiting (0.31+); vllm/v1/core/sched/scheduler.py `Scheduler.schedule`.
The cadence (`prefill_schedule_interval`, 0.33): see `sim.engine.cadence`. The schedulers call
`_hold` as a step starts, `_released` after a WAITING scan the step did not hold, and `_end_prefill`
when the step is chosen; while `prefill_held` they skip running requests mid-prefill and stop the
WAITING scan at the first request with prompt left to compute.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sim.engine.cadence import PrefillCadence

if TYPE_CHECKING:
    from kvcache.manager import KVCacheManager
    from sim.engine.batch import Batch, Live
    from sim.engine.config import SimConfig


class PrefillRules:
    """The long-prefill cap and the cadence (attributes `running`, `waiting`, `max_tokens` are the scheduler's)."""

    def _init_prefill(self, cfg: SimConfig, manager: KVCacheManager) -> None:
        self.long_prefill = cfg.long_prefill_token_threshold
        self.long_prefill_sole_request = manager.profile.long_prefill_sole_request
        self.adaptive = cfg.long_prefill_token_threshold_adaptive
        self.input_tokens = cfg.batch_limits()[0]  # the forward's size: the adaptive cap's floor divides it
        self._chunk = self.long_prefill  # this step's cap on a request's chunk (0: none), see schedule
        every = cfg.prefill_schedule_interval if manager.profile.local_prefill_cadence else 1
        self.cadence = PrefillCadence(every) if every > 1 else None
        self.prefill_held = False  # this step holds prefill back (the cadence)
        self._prefilled = False  # this step carried prefill: a running request mid-prefill, or an admission

    def _eligible(self) -> int:
        """Requests running or waiting (vLLM `get_request_counts`, summed)."""
        return len(self.running) + len(self.waiting)

    def chunk_cap(self, eligible: int) -> int:
        """A step's cap on one request's prefill chunk (0: none) with `eligible` requests running or waiting."""
        cap = self.long_prefill
        if not cap or (eligible <= 1 and self.long_prefill_sole_request):
            return 0
        if self.adaptive:
            return max(cap, self.input_tokens // eligible)
        return cap

    # NOTE: these four are called only where there is a cadence (`self.cadence` is not None); `_skipped` checks
    def _hold(self) -> None:
        """A step starts: whether the cadence holds its prefill back."""
        self.prefill_held = self.cadence.holds(self.running)
        self._prefilled = False

    def _released(self) -> None:
        """The WAITING scan is done (no preemption this step): a step that did not hold records
        whether requests still wait beyond the skipped ones."""
        if not self.prefill_held:
            self.cadence.released(self._eligible() - len(self.running))

    def _end_prefill(self, b: Batch) -> None:
        self.cadence.end(b.num_seqs > 0, self._prefilled)

    def _admitted_prefill(self, live: Live, hit: int) -> None:
        """`live` was admitted with `hit` tokens computed: it carries prefill unless only its last token is left."""
        self.cadence.deferred.discard(live)
        if hit < live.seq.num_tokens - 1:
            self._prefilled = True

    def _skipped(self, live: Live) -> None:
        """The WAITING scan skipped `live` (vLLM `skip_request`)."""
        if self.cadence is not None:
            self.cadence.deferred.add(live)
