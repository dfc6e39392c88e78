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
sees it). An empty step polls and applies at once. A read takes `KVTransfer.seconds` of its blocks,
each at its kind's bytes on one rank (`BlockBytes`).

Hybrid models (vLLM's KV-cache groups; base_scheduler.py `_is_hma_required`): the decode side reads
every group's blocks past its local hit, the blocks its load got (pull_scheduler.py
`update_state_after_alloc`: `get_unhashed_block_ids_all_groups`, clipped by `get_exchange_clipped_blocks`
to a window's last cdiv(window, block) + 1, which a load's window blocks never exceed:
`kvcache.hybrid_loads`), each an attention group's block at a pool block's bytes (pull_worker.py reads
a group's block across every layer region, a whole page each); a finished request's windows first let
go of the blocks they skip (scheduler.py `_connector_finished` calls `remove_skipped_blocks` before
`request_finished`), then the prefill side holds the rest.

Mamba state (vLLM's "align" mode): the prefill side drops the prompt's last token
(base_scheduler.py `_prefill_backoff`, 1 with Mamba layers; `_truncate_request_for_prefill` from
`on_new_request`: `with_max_tokens_one` with the backoff), so the decode side can compute the state
after it; at the finish each Mamba group has let go of every state before its running one
(`MambaManager.remove_skipped_blocks`), and the held blocks are what `request_finished` offers
(`clip_ssm_state_blocks`: one state block a Mamba group). The decode side reads the prompt less the
backoff (`lookup`). vLLM's NIXL connector completes divergent local hits (connector.py
`supports_divergent_local_hybrid_hits`, kvsim's `divergent_hits`), so its scheduler asks the manager's
per-group lookup (scheduler.py `_get_local_prefix_cache_hit`, kv_cache_manager.py
`get_computed_blocks_for_connector`): full attention's own hit is the local prefix, with each group's
own blocks, unless a group hit deeper (then the reconciled hit); when such a hit ran past a lagging
Mamba state and nothing is loaded, the scheduler reconciles (`get_computed_blocks`). A load gives each
Mamba group null blocks and one new block, the state the read writes (`kvcache.hybrid_loads`), so a
read is the attention blocks past the hit at a pool block's bytes plus one state block a Mamba group
at the state's own bytes: the worker reads a Mamba layer's conv sub-projections and SSM state, not its
padded page (base_worker.py `_build_mamba_local`, `_build_mamba_remote`; ssm_conv_transfer_utils.py
`derive_mamba_conv_split`'s `ssm_sizes`), so `BlockBytes.state` is `HybridLayout.state_read_bytes`
(qwen3-next-80b-a3b at TP 8: 12 x 137,216 bytes against a 12 x 196,608-byte pool block). A remote
request admitted with nothing to read (its hit reaches the prompt less the backoff) is remote no more
and only notifies the prefill side, which lets its blocks go (pull_worker.py
`start_load_kv`: no read reported).

A lone replica plays one role for every request (`SimConfig.kv_transfer_role`); the decode side
standing alone reads from a prefill side assumed idle, and the prefill side standing alone is read
by a decode side that reads as soon as the request finishes. A cluster of pools (not yet) tells each
replica which requests are remote.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvsim.kvcache.manager import KVCacheManager
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
class BlockBytes:
    """One rank's bytes of each kind of block a NIXL read moves, for one model's layout: an attention
    block (a page of every layer of its group: pull_worker.py reads whole pages, `kv_bytes_per_block`)
    and a Mamba group's state block (its conv and SSM state alone, `HybridLayout.state_read_bytes`);
    and the Mamba groups, each with one state block in a read or a hold (`kvcache.hybrid_loads`: a
    load gives a Mamba group one new block; base_scheduler.py `clip_ssm_state_blocks`)."""

    attention: int
    state: int = 0
    state_groups: int = 0

    @classmethod
    def of(cls, cost: Any) -> BlockBytes:
        """The block bytes of the model a `CostModel` prices, from its layout (the one place a Mamba
        state's bytes are worked out)."""
        layout = cost.layout
        if layout is None or not layout.has_mamba:
            return cls(cost.kv_bytes_per_block)
        return cls(cost.kv_bytes_per_block, layout.state_read_bytes, layout.num_state_groups)

    def split(self, blocks: int) -> tuple[int, int]:
        """(attention blocks, state blocks) of a read or a hold of `blocks` blocks."""
        if not blocks or not self.state_groups:
            return blocks, 0
        if blocks < self.state_groups:
            raise ValueError(f"a read of {blocks} blocks has fewer than its {self.state_groups} Mamba state blocks")
        return blocks - self.state_groups, self.state_groups

    def read_bytes(self, blocks: int) -> int:
        """One rank's bytes of a read of `blocks` blocks."""
        return self.bytes_of(*self.split(blocks))

    def bytes_of(self, attention: int, states: int = 0) -> int:
        """One rank's bytes of `attention` attention blocks and `states` Mamba state blocks."""
        return attention * self.attention + states * self.state


@dataclass(frozen=True, slots=True)
class KVTransfer:
    """How long one whole-request read takes: a fixed latency plus its bytes over the link's bandwidth.
    Each tensor-parallel rank reads its own share of every block over its own NIC, in parallel, so
    the bytes are one rank's (`block_bytes`)."""

    block_bytes: BlockBytes
    gbps: float = DEFAULT_GBPS
    latency_s: float = DEFAULT_LATENCY_S

    def seconds(self, blocks: int, states: int = 0) -> float:
        """The read of `blocks` attention blocks and `states` Mamba state blocks, from its post to its end."""
        return self.latency_s + self.block_bytes.bytes_of(blocks, states) / (self.gbps * 1e9)


def prefill_backoff(cost: Any) -> int:
    """The trailing prompt tokens the prefill side leaves for the decode side to recompute, for a model
    priced by `cost` (a `CostModel`): one with Mamba state in its hybrid layout, whose decode side needs
    the state before the last prompt token (base_scheduler.py `_prefill_backoff`; its bounded-replay and
    multi-token-prediction terms are 0 in kvsim's catalog)."""
    return 1 if cost.layout is not None and cost.layout.has_mamba else 0


def with_max_tokens_one(req: Request, backoff: int = 0) -> Request:
    """The request a P/D proxy sends the prefill side (one output token: vLLM's
    examples/online_serving/disaggregated_serving proxies and llm-d's sidecar set max_tokens 1), as
    the prefill side runs it: less its last `backoff` prompt tokens when the prompt is longer
    (base_scheduler.py `_truncate_request_for_prefill`, from `on_new_request`)."""
    if not backoff or req.prompt_len <= backoff:
        return req.sharing_prompt(output_len=1, output=None)
    keep = req.prompt_len - backoff
    return req.sharing_prompt(prompt_len=keep, output_len=1, output=None, _prompt=req.prompt[:keep])


class LoneTransport:
    """The other side of a replica standing alone in one role for every request (`kv_transfer_role`):
    a decode side's reads take `KVTransfer.seconds` from their post; a prefill side is read by a decode
    side that reads as soon as the request finishes (the lease bounding the hold)."""

    def __init__(self, transfer: KVTransfer, role: str, lease_s: float = DEFAULT_LEASE_S):
        if role not in ROLES:
            raise ValueError(f"kv_transfer_role must be one of {', '.join(ROLES)}, got {role!r}")
        self.transfer = transfer
        self.role = role
        self.lease_s = lease_s
        self._ends: dict[str, float] = {}

    def remote_prefill(self, rid: str) -> bool:
        """Whether request `rid`'s prompt was computed by a prefill replica (vLLM `do_remote_prefill`)."""
        return self.role == "decode"

    def remote_decode(self, rid: str) -> bool:
        """Whether request `rid` is a prefill replica's, read by a decode replica (`do_remote_decode`)."""
        return self.role == "prefill"

    def post(self, rid: str, blocks: int, states: int, at: float) -> None:
        """The decode side posts its read of `blocks` attention blocks and `states` state blocks at `at`."""
        self._ends[rid] = at + self.transfer.seconds(blocks, states)

    def read_end(self, rid: str, now: float) -> float | None:
        """When `rid`'s read ends, if known for good by `now`."""
        return self._ends.get(rid)

    def read_eta(self, rid: str) -> float:
        """When `rid`'s read would end as things stand."""
        return self._ends[rid]

    def read_seen(self, rid: str) -> None:
        """The decode side applied `rid`'s read."""
        del self._ends[rid]

    def dropped(self, rid: str, now: float) -> None:
        """The decode side dropped `rid` before reading it, or needs none of it (a full local hit)."""

    def release_at(self, rid: str, finished: float, blocks: int, states: int, now: float) -> float | None:
        """When the prefill side hears that `rid` (finished at `finished`, holding `blocks` attention
        blocks and `states` state blocks) was read, or its lease ended; None: not known yet."""
        return finished + min(self.transfer.seconds(blocks, states), self.lease_s)

    def release_bound(self, rid: str, finished: float) -> float:
        """A time by which the prefill side must look again (the lease's end)."""
        return finished + self.lease_s

    def freed(self, rid: str, now: float) -> None:
        """The prefill side freed `rid`'s held blocks at `now`."""


class NixlConnector:
    """The NIXL connector as the scheduler sees it, over a transport that says which requests are
    remote and when their reads end (`LoneTransport`; a P/D cluster's, `sim.cluster.pd`).

    It reads no running sequence between admissions (its reads start, and its holds end, at step
    boundaries, by request id), so the scheduler keeps its exact speed shortcuts with it
    (`allows_shortcuts`; lazy decodes, the blocked head), and hands it the shortcuts' free
    (`free_seq`: a held request's lazily filled blocks are cached as it is freed)."""

    allows_shortcuts = True
    # a load completes a hybrid hit whose Mamba state lags full attention's (connector.py
    # `NixlBaseConnector.supports_divergent_local_hybrid_hits`): the scheduler asks the manager's
    # per-group lookup (`get_computed_blocks_for_connector`)
    divergent_hits = True

    def __init__(self, manager: KVCacheManager, priority: bool, transport: LoneTransport, block_bytes: BlockBytes,
                 backoff: int = 0):
        self.m = manager
        self.backoff = backoff  # (`prefill_backoff`: the prompt tokens the decode side recomputes)
        self.free_seq = manager.free
        self.transport = transport
        self.block_bytes = block_bytes
        self.async_loads = AsyncLoads(manager, priority)
        self.holding = self.async_loads.holding
        self._remote_done: set[str] = set()  # decode side: requests whose remote prompt was allocated
        self._planned: list[tuple[str, int | None]] = []  # this step's reads: (request, blocks; None: notice only)
        self._reads: set[str] = set()  # reads in flight
        self._applied: set[str] = set()  # reads applied, until the request is promoted
        self._held: dict[str, tuple[Live, float, int]] = {}  # prefill side: request -> (live, finished, blocks held)
        self.read_blocks = 0
        self.read_tokens = 0
        self.read_bytes = 0  # one rank's, each block at its kind's bytes (`BlockBytes.read_bytes`)
        self.held_block_seconds = 0.0  # prefill side: blocks held after finishing x seconds held

    # ------------------------------------------------------------- state
    def has_work(self) -> bool:
        """Requests held for a read, reads in flight, or finished requests whose blocks are held for
        the decode side (vLLM's engine keeps stepping: `Scheduler.has_requests`, `has_finished_requests`)."""
        return bool(self.holding or self._reads or self._planned or self._held)

    def in_flight(self, now: float) -> bool:
        """Whether a read is in flight or a finished request's blocks are held for the decode side: an
        empty batch then waits for it (the engine spins), it does not stall."""
        return bool(self._reads or self._held)

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
        if not (self._reads or self._held):
            return None
        return self.next_change(now)  # (inf: a held request's read is not posted yet; a poke wakes it)

    def next_change(self, now: float) -> float:
        """The earliest time a poll could find a read or a release done, as things stand at `now`
        (-inf while reads wait to be posted or landed requests to be promoted; inf with nothing in
        flight): a quiet run of decode-only steps (`sim.engine.quiet`) stops before a step starting
        then."""
        if self._planned or self._applied:
            return -math.inf
        t = self.transport
        times = [t.read_eta(rid) for rid in self._reads]
        split = self.block_bytes.split
        for rid, (_, finished, blocks) in self._held.items():
            at = t.release_at(rid, finished, *split(blocks), now)
            times.append(at if at is not None else t.release_bound(rid, finished))
        return min(times, default=math.inf)

    def take_events(self) -> list:
        """The connector's KV events: none (vLLM 0.33's NixlConnector keeps `KVConnectorBase_V1.take_events`,
        which yields nothing)."""
        return []

    def totals(self) -> dict[str, int | float]:
        """The run's transfer figures for its summary."""
        return {"read_blocks": self.read_blocks, "read_tokens": self.read_tokens,
                "read_bytes": self.read_bytes,
                "held_block_seconds": self.held_block_seconds}

    # ------------------------------------------------------------- the step
    def begin_step(self, now: float) -> None:
        pass

    def end_step(self, b: Batch, now: float) -> None:
        """The schedule is chosen at `now`: its reads are posted as its forward is launched."""
        self.async_loads.schedule_chosen(b)
        self._start_planned(now)

    def launched(self, b: Batch, end: float) -> None:
        """Reads start with the step (see the module docstring), not at its end."""

    def step_ended(self, b: Batch, now: float) -> None:
        """Step `b` (started `b.start`) ended at `now`: apply what its poll saw."""
        self._poll_apply(b.start, now)

    def _start_planned(self, at: float) -> None:
        for rid, blocks in self._planned:
            if blocks is None:  # nothing to read: the prefill side is told to let go (pull_worker.py
                self.transport.dropped(rid, at)  # `_read_blocks`, a full local hit's notification)
                continue
            self.transport.post(rid, *self.block_bytes.split(blocks), at)
            self._reads.add(rid)
        self._planned.clear()

    def _poll_apply(self, poll: float, now: float) -> bool:
        """Apply the reads and releases known by `now` to be done by `poll` (a release frees the
        request's blocks, the held requests in the order they finished); whether any was."""
        t, split = self.transport, self.block_bytes.split
        done = [rid for rid in self._reads if (end := t.read_end(rid, now)) is not None and end <= poll]
        for rid in done:
            self._reads.discard(rid)
            t.read_seen(rid)
            self._applied.add(rid)
        released = [rid for rid, (_, finished, blocks) in self._held.items()
                    if (at := t.release_at(rid, finished, *split(blocks), now)) is not None and at <= poll]
        for rid in released:
            live, finished, blocks = self._held.pop(rid)
            self.held_block_seconds += blocks * (now - finished)
            self.free_seq(live.seq)
            t.freed(rid, now)
        return bool(done or released)

    # ------------------------------------------------------------- admission (decode side)
    def lookup(self, seq: Sequence, hit: int) -> int:
        """The prompt tokens past the local `hit` to read from the prefill side (vLLM
        `get_num_new_matched_tokens`, `_get_remote_prefill_token_count`): the prompt less its
        `backoff` tokens (when longer) less the local hit, once; 0 afterwards."""
        rid = seq.seq_id
        if rid in self._remote_done or not self.transport.remote_prefill(rid):
            return 0
        remote = seq.num_prompt_tokens
        if self.backoff and remote > self.backoff:
            remote -= self.backoff
        return max(remote - hit, 0)

    def start_load(self, live: Live, hit: int, blocks: list, ext: int, *, watermark: bool, whole: bool) -> bool:
        """Give `live` blocks for its `hit` and `ext` remote tokens and plan its read (vLLM
        `allocate_slots` with external tokens, then `update_state_after_alloc`); False: they do not fit."""
        new = self.async_loads.allocate(live, hit, blocks, ext, watermark=watermark, whole=whole)
        if new is None:
            return False
        rid = live.seq.seq_id
        self._remote_done.add(rid)
        self._planned.append((rid, len(new)))
        self.read_blocks += len(new)
        self.read_tokens += ext
        self.read_bytes += self.block_bytes.read_bytes(len(new))
        return True

    def landed(self, seq: Sequence) -> int | None:
        """A held request's computed tokens once its read is applied, or None: not yet. With op
        records the read's tokens are recorded as written into their blocks when it is applied."""
        rid = seq.seq_id
        applied = rid in self._applied
        self._applied.discard(rid)
        if applied and self.m.records_ops and rid not in self.async_loads.landed:
            hit, ext = self.async_loads.loads[rid]
            self.m.record_loaded(seq, hit, hit + ext)
        return self.async_loads.land(seq, applied)

    def admitted(self, live: Live, hit: int, n: int, first: bool) -> int:
        """`live` runs with `hit` computed; returns the tokens of the hit that came from the prefill
        side (the log counts only the local hit). A remote request admitted with nothing to read (a
        local hit reaching the prompt less its backoff) is remote no more, and its prefill side is
        notified (pull_scheduler.py `update_state_after_alloc` with no external tokens; the worker
        reports no read for it: pull_worker.py `start_load_kv`)."""
        rid = live.seq.seq_id
        if rid not in self._remote_done and self.transport.remote_prefill(rid):
            self._remote_done.add(rid)
            self._planned.append((rid, None))
        loaded = self.async_loads.admitted(live, hit, n)
        return hit - loaded[0] if loaded is not None and first else 0

    # ------------------------------------------------------------- leaving
    def preempted(self, live: Live) -> None:
        self.async_loads.leaving(live.seq.seq_id)

    def retiring(self, live: Live, offers: bool, now: float) -> bool:
        """`live` is done at `now`; True if its blocks are held (the prefill side's finished request,
        read by the decode side later: vLLM `request_finished` returns `delay_free_blocks`). A decode
        side's request dropped before its read lets the prefill side go."""
        seq = live.seq
        rid = seq.seq_id
        self.async_loads.leaving(rid)
        t = self.transport
        if t.remote_prefill(rid) and rid not in self._remote_done:
            t.dropped(rid, now)
        m = self.m
        if m.num_groups > 1 and m.holds_blocks(rid):
            m.remove_skipped_blocks(seq)  # (vLLM `Scheduler._connector_finished`, before request_finished)
        if not t.remote_decode(rid) or not offers or not m.holds_blocks(rid):
            return False
        self._held[rid] = (live, now, m.num_held_blocks(rid))
        return True
