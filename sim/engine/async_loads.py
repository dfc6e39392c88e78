"""The requests a KV connector loads asynchronously, as vLLM 0.33's `Scheduler` keeps them whatever
the connector (vllm/v1/core/sched/scheduler.py): the requests holding blocks while their KV arrives
(`kv_holding_waiting`, status `WAITING_FOR_REMOTE_KVS`), the in-flight prefills whose remaining blocks
an async load must leave free (`_inflight_prefills`, `_inflight_prefill_reserved_blocks`), and the
promotion once a load is applied (`_update_waiting_for_remote_kv`: the loaded blocks are cached, and a
load reaching every token recomputes the last one, whose logits are needed).

Each connector (`sim.engine.offload_connector`, KV offloading; `sim.engine.nixl`, P/D
disaggregation's decode side) holds one and says where its tokens come from and when they land.
"""

from __future__ import annotations

from kvsim.kvcache.manager import KVCacheManager
from kvsim.kvcache.sequence import Sequence
from kvsim.sim.engine.batch import Batch, Live
from kvsim.sim.engine.wait_queue import WaitQueue


class AsyncLoads:
    """Requests loading KV beside the schedule, and the prefills still in flight."""

    def __init__(self, manager: KVCacheManager, priority: bool):
        self.m = manager
        self.holding = WaitQueue(priority)  # requests holding blocks for a load (vLLM kv_holding_waiting)
        self.landed: set[str] = set()  # of those, the ones whose load is applied
        self.loads: dict[str, tuple[int, int]] = {}  # a loading request's local hit and loaded tokens
        self.inflight: dict[str, Live] = {}  # requests still prefilling (vLLM _inflight_prefills)

    def allocate(self, live: Live, hit: int, blocks: list, ext: int, *, watermark: bool, whole: bool) -> list | None:
        """Blocks for `live`'s `hit` cached tokens and `ext` loaded ones, net of the blocks the other
        in-flight prefills still need (vLLM `allocate_slots` with `reserved_blocks`); None: they do not
        fit. On success the request counts as loading and in flight, its tokens as computed."""
        m, seq = self.m, live.seq
        reserved = sum(m.blocks_to_finish(x.seq) for x in self.inflight.values())
        new = m.allocate_for_load(seq, hit, blocks, ext, reserved=reserved, watermark=watermark, whole=whole)
        if new is None:
            return None
        sid = seq.seq_id
        seq.num_computed_tokens = hit + ext
        self.loads[sid] = (hit, ext)
        self.inflight[sid] = live
        return new

    def land(self, seq: Sequence, applied: bool) -> int | None:
        """A held request's computed tokens once its load is `applied` (vLLM
        `_update_waiting_for_remote_kv`, once), or None: not yet."""
        sid = seq.seq_id
        if sid not in self.landed:
            if not applied:
                return None
            self.landed.add(sid)
            self.m.cache_blocks(seq, seq.num_computed_tokens)
            if seq.num_computed_tokens == seq.num_tokens:
                seq.num_computed_tokens -= 1
        return seq.num_computed_tokens

    def admitted(self, live: Live, hit: int, n: int) -> tuple[int, int] | None:
        """`live` runs with `hit` computed and `n` scheduled: it stays in flight while its prefill is
        unfinished. Returns its load's (local hit, loaded tokens), if it was held for one."""
        sid = live.seq.seq_id
        self.landed.discard(sid)
        loaded = self.loads.pop(sid, None)
        if hit + n < live.seq.num_tokens:
            self.inflight[sid] = live
        else:
            self.inflight.pop(sid, None)
        return loaded

    def schedule_chosen(self, b: Batch) -> None:
        """Step `b`'s schedule is chosen (vLLM `_update_after_schedule`, before any computed token
        advances): an in-flight request that `b` gives every known token (plus placeholders) is
        prefilling no more and leaves the set. So does one the speed shortcuts decode outside the
        batch (in place or lazily: `Shortcuts.decode`), a token past its prompt. One not scheduled
        stays, as in vLLM; a request still loading is not scheduled."""
        loads = self.loads
        prefilling = [(sid, live) for sid, live in self.inflight.items() if sid not in loads]
        if not prefilling:  # (the loads in flight, often all there is on a decode side)
            return
        chunks = {id(x): n for x, n in zip(b.lives, b.tokens, strict=True)}
        decoded = {id(x) for x in b.decodes}
        for sid, live in prefilling:
            n = chunks.get(id(live))
            if n is None:
                done = live.since >= 0 or id(live) in decoded
            else:
                seq = live.seq
                done = seq.num_computed_tokens + n >= seq.num_tokens + live.ph
            if done:
                del self.inflight[sid]

    def leaving(self, sid: str) -> None:
        """`sid` is preempted or done: no longer in flight."""
        self.inflight.pop(sid, None)
