"""Prefill/decode disaggregation's KV connector, the scheduler side: vLLM 0.33's `NixlConnector` in
its default pull mode (vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py
`NixlPullConnectorScheduler`, base_scheduler.py `NixlBaseConnectorScheduler`), as vLLM's `Scheduler`
calls it (vllm/v1/core/sched/scheduler.py), and the timing of its worker's reads.

The decode side (a request whose prompt a prefill replica computed, vLLM's `do_remote_prefill`):
- at its first admission, `get_num_new_matched_tokens` offers the prompt less the backoff
  (`_get_remote_prefill_token_count`: 0 tokens for a model without Mamba state or bounded replay)
  less the local prefix hit, loaded asynchronously;
- the scheduler allocates blocks for the whole prompt at once, net of the blocks other in-flight
  prefills still need, or the request waits (`sim.engine.async_loads`); once allocated, the
  request's remote flag is cleared (`update_state_after_alloc`), so a later preemption recomputes
  locally;
- the blocks past the local hit are read in one whole-request read; the request waits in
  WAITING_FOR_REMOTE_KVS until the read is applied, then its blocks are cached and its last prompt
  token is recomputed (`_update_waiting_for_remote_kv`), and it decodes. No per-layer overlap: the
  pull connector reads whole requests.

The prefill side (vLLM's `do_remote_decode`): the request runs with `max_tokens = 1` (the proxy's,
`with_max_tokens_one`). When it finishes, `request_finished` delays the free of its blocks (they
stay allocated, their cached prefix unevictable) until the decode side's notification that the read
is done, or until the lease (`kv_lease_duration`, 30 s) expires; then they are freed into the prefix
cache (`Scheduler._update_from_kv_xfer_finished`, after the step's own finished requests).

Timing (vllm/v1/worker/kv_connector_model_runner_mixin.py `_get_kv_connector_output`): a step's reads
are posted right after its forward is launched (`start_load_kv`), so a read admitted in a step starts
with it; the worker's `get_transfer_results` is polled as the step is launched, so a transfer is seen
by the first step that starts once it is done and applied when that step ends (the schedule after it
sees it). An empty step polls and applies at once. A read takes `KVTransfer.seconds` of its blocks.

A lone replica plays one role for every request (`SimConfig.kv_transfer_role`); the decode side
standing alone reads from a prefill side assumed idle, and the prefill side standing alone is read
by a decode side that reads as soon as the request finishes. A cluster of pools (not yet) tells each
replica which requests are remote.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvsim.kvcache.manager import KVCacheManager, cdiv
from kvsim.kvcache.sequence import Sequence
from kvsim.sim.engine.async_loads import AsyncLoads
from kvsim.sim.engine.batch import Batch, Live
from kvsim.workloads.request import Request

ROLES = ("decode", "prefill")
# BLIS (inference-sim) models a NIXL transfer over RDMA as a base latency plus bytes over bandwidth;
# these are its defaults (25 GB/s a GPU's NIC, 0.05 ms a transfer)
DEFAULT_GBPS = 25.0
DEFAULT_LATENCY_S = 5e-5
# vLLM 0.33 NixlBaseConnectorScheduler: kv_transfer_config.kv_connector_extra_config["kv_lease_duration"]
DEFAULT_LEASE_S = 30.0


@dataclass(frozen=True, slots=True)
class KVTransfer:
    """How long one whole-request read takes: a fixed latency plus its bytes over the link's bandwidth.
    Each tensor-parallel rank reads its own share of every block over its own NIC, in parallel, so
    the bytes are one rank's (`bytes_per_block`)."""

    bytes_per_block: int
    gbps: float = DEFAULT_GBPS
    latency_s: float = DEFAULT_LATENCY_S

    def seconds(self, blocks: int) -> float:
        """The read of `blocks` blocks, from its post to its end."""
        return self.latency_s + blocks * self.bytes_per_block / (self.gbps * 1e9)


def with_max_tokens_one(req: Request) -> Request:
    """The request a P/D proxy sends the prefill side: the same prompt, one output token
    (vLLM's examples/online_serving/disaggregated_serving proxies and llm-d's sidecar set max_tokens 1)."""
    return replace(req, output_len=1, output=None)


class NixlConnector:
    """The NIXL connector as the scheduler sees it, one role for every request (module docstring)."""

    def __init__(self, manager: KVCacheManager, priority: bool, transfer: KVTransfer, role: str,
                 lease_s: float = DEFAULT_LEASE_S):
        if role not in ROLES:
            raise ValueError(f"kv_transfer_role must be one of {', '.join(ROLES)}, got {role!r}")
        self.m = manager
        self.transfer = transfer
        self.role = role
        self.lease_s = lease_s
        self.async_loads = AsyncLoads(manager, priority)
        self.holding = self.async_loads.holding
        self._remote_done: set[str] = set()  # decode side: requests whose remote prompt was allocated
        self._planned: list[tuple[str, int]] = []  # this step's reads: (request, blocks)
        self._reads: dict[str, float] = {}  # reads in flight: request -> when done
        self._applied: set[str] = set()  # reads applied, until the request is promoted
        self._held: dict[str, tuple[Live, float]] = {}  # prefill side: finished requests -> release time
        self._now = 0.0
        self.read_blocks = 0
        self.read_tokens = 0
        self.held_block_seconds = 0.0  # prefill side: blocks held after finishing x seconds held
        self._held_blocks: dict[str, tuple[int, float]] = {}

    # ------------------------------------------------------------- state
    def has_work(self) -> bool:
        """Requests held for a read, reads in flight, or finished requests whose blocks are held for
        the decode side (vLLM's engine keeps stepping: `Scheduler.has_requests`, `has_finished_requests`)."""
        return bool(self.holding or self._reads or self._planned or self._held)

    def holds_finished(self) -> bool:
        """Whether finished requests' blocks are held for the decode side (a request that does not fit
        waits for them, as vLLM's does)."""
        return bool(self._held)

    def idle_until(self, now: float) -> float | None:
        """An empty step at `now`: poll and apply; the time to schedule again (now if something was
        applied), or None if nothing is in flight."""
        self._start_planned(now)
        if self._poll_apply(now, now):
            return now
        times = [*self._reads.values(), *(t for _, t in self._held.values())]
        return min(times, default=None)

    def totals(self) -> dict[str, int | float]:
        """The run's transfer figures for its summary."""
        return {"read_blocks": self.read_blocks, "read_tokens": self.read_tokens,
                "read_bytes": self.read_blocks * self.transfer.bytes_per_block,
                "held_block_seconds": self.held_block_seconds}

    # ------------------------------------------------------------- the step
    def begin_step(self, now: float) -> None:
        self._now = now

    def end_step(self, b: Batch, now: float) -> None:
        """The schedule is chosen at `now`: its reads are posted as its forward is launched."""
        self._start_planned(now)

    def launched(self, b: Batch, end: float) -> None:
        """Reads start with the step (see the module docstring), not at its end."""

    def step_ended(self, b: Batch, now: float) -> None:
        """Step `b` (started `b.start`) ended at `now`: apply what its poll saw; free the held
        requests whose read was done."""
        self.async_loads.step_ended()
        self._poll_apply(b.start, now)

    def _start_planned(self, at: float) -> None:
        for sid, blocks in self._planned:
            self._reads[sid] = at + self.transfer.seconds(blocks)
        self._planned.clear()

    def _poll_apply(self, poll: float, now: float) -> bool:
        """Apply the reads and releases done by `poll` at `now` (the release frees blocks, in the
        order the requests finished); whether anything was applied."""
        done = [sid for sid, t in self._reads.items() if t <= poll]
        for sid in done:
            del self._reads[sid]
            self._applied.add(sid)
        released = [sid for sid, (_, t) in self._held.items() if t <= poll]
        for sid in released:
            live, _ = self._held.pop(sid)
            blocks, since = self._held_blocks.pop(sid)
            self.held_block_seconds += blocks * (now - since)
            self.m.free(live.seq)
        return bool(done or released)

    # ------------------------------------------------------------- admission (decode side)
    def lookup(self, seq: Sequence, hit: int) -> int:
        """The prompt tokens past the local `hit` to read from the prefill side (vLLM
        `get_num_new_matched_tokens`): the whole prompt less the local hit, once; 0 afterwards."""
        if self.role != "decode" or seq.seq_id in self._remote_done:
            return 0
        return max(seq.num_prompt_tokens - hit, 0)

    def start_load(self, live: Live, hit: int, blocks: list, ext: int, *, watermark: bool, whole: bool) -> bool:
        """Give `live` blocks for its `hit` and `ext` remote tokens and plan its read (vLLM
        `allocate_slots` with external tokens, then `update_state_after_alloc`); False: they do not fit."""
        new = self.async_loads.allocate(live, hit, blocks, ext, watermark=watermark, whole=whole)
        if new is None:
            return False
        sid = live.seq.seq_id
        self._remote_done.add(sid)
        self._planned.append((sid, len(new)))
        self.read_blocks += len(new)
        self.read_tokens += ext
        return True

    def landed(self, seq: Sequence) -> int | None:
        """A held request's computed tokens once its read is applied, or None: not yet."""
        sid = seq.seq_id
        applied = sid in self._applied
        self._applied.discard(sid)
        return self.async_loads.land(seq, applied)

    def admitted(self, live: Live, hit: int, n: int, first: bool) -> int:
        """`live` runs with `hit` computed; returns the tokens of the hit that came from the prefill
        side (the log counts only the local hit)."""
        loaded = self.async_loads.admitted(live, hit, n)
        return hit - loaded[0] if loaded is not None and first else 0

    # ------------------------------------------------------------- leaving
    def preempted(self, live: Live) -> None:
        self.async_loads.leaving(live.seq.seq_id)

    def retiring(self, live: Live, offers: bool, now: float) -> bool:
        """`live` is done at `now`; True if its blocks are held (the prefill side's finished request,
        read by the decode side later: vLLM `request_finished` returns `delay_free_blocks`). Standing
        alone, the decode side reads the prompt's blocks at once; the lease bounds the hold."""
        seq = live.seq
        sid = seq.seq_id
        self.async_loads.leaving(sid)
        if self.role != "prefill" or not offers or not self.m.holds_blocks(sid):
            return False
        read = self.transfer.seconds(cdiv(seq.num_prompt_tokens, self.m.block_size))
        self._held[sid] = (live, now + min(read, self.lease_s))
        self._held_blocks[sid] = (len(self.m.block_tables[sid]), now)
        return True
