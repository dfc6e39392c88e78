"""vLLM 0.33.0's Scheduler with P/D disaggregation's NixlConnector in one role, on the cost clock,
for diffing against kvsim's engine with `SimConfig.kv_transfer_role` (`sim.engine.nixl`).

vLLM's side is built as `vllm serve --kv-transfer-config '{"kv_connector": "NixlConnector",
"kv_role": "kv_both"}'` builds it (`vllm_setup.stand_in_config`): the Scheduler makes the connector
with role SCHEDULER (vllm/distributed/kv_transfer/kv_connector/v1/nixl/connector.py
`NixlPullConnector`, whose scheduler side is pull_scheduler.py `NixlPullConnectorScheduler`), every
default vLLM's own (the lease, `kv_lease_duration`, is kvsim's). It constructs on this CPU-only
host: the scheduler side needs neither nixl nor a socket until the engine core hands it the
workers' handshake metadata (base_scheduler.py `set_xfer_handshake_metadata` starts the side-channel
listener); there is no worker here, so that is never called and no thread or socket is opened.

The requests reach vLLM as a P/D proxy sends them (vLLM's tests/v1/kv_connector/nixl_integration/
toy_proxy_server.py): the prefill side gets `do_remote_decode` and max_tokens 1; the decode side gets
what the prefill side's `request_finished` returns (`do_remote_prefill`, the remote block ids,
engine, request, host, port, tp size, ...), from a prefill side standing idle.

The transfer itself is `NixlWorker`, timed as kvsim's `sim.engine.nixl` times it:
- decode side: each step's `reqs_to_recv` (`build_connector_meta`) start when the step starts and
  last `KVTransfer.seconds` of the blocks vLLM allocated for them, a block of one of vLLM's Mamba
  groups (a `MambaSpec` group of its KV-cache config) at the state's bytes, every other block at a
  pool block's; a read is reported in
  `finished_recving` by the first step starting once it is done (its poll,
  kv_connector_model_runner_mixin.py `_get_kv_connector_output`), and applied as that step ends;
- prefill side: a request in `reqs_to_send` is reported in `finished_sending` by the first step
  starting at or after its finish + `KVTransfer.seconds` of its blocks, priced alike (capped by the lease), as
  kvsim's lone prefill side assumes a decode side that reads at once.

vLLM passes `finished_sending` as a set, and `_update_from_kv_xfer_finished` frees the requests in
its iteration order, which for strings follows PYTHONHASHSEED. The fake worker hands an
insertion-ordered set instead, in the order vLLM finished the requests (`reqs_to_send`'s order),
which is the order kvsim frees them in (`NixlConnector._poll_apply`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvsim.sim.conform.vllm_offload import _OrderedIds
from kvsim.sim.conform.vllm_timed import _TimedRun
from kvsim.sim.engine.config import ConfigError, SimConfig
from kvsim.sim.engine.nixl import BlockBytes, KVTransfer, with_max_tokens_one
from kvsim.workloads.request import Request

# the prefill side kvsim's decode side reads from, as its `request_finished` names itself
# (base_scheduler.py: its engine id, VLLM_NIXL_SIDE_CHANNEL_HOST and _PORT's defaults, tp size)
REMOTE = {"remote_engine_id": "kvsim-prefill", "remote_host": "localhost", "remote_port": 5600, "tp_size": 1,
          "dcp_size": 1, "pp_size": 1}


@dataclass(frozen=True)
class Nixl:
    """kvsim's role, transfer timing and lease, as vLLM's connector and the fake worker must see them."""

    role: str
    transfer: KVTransfer
    lease_s: float

    @classmethod
    def from_config(cls, cfg: SimConfig, block_bytes: BlockBytes) -> Nixl | None:
        """The NIXL side of `cfg` (None: no `kv_transfer_role`), its reads priced as kvsim's lone
        connector prices them (`KVTransfer` of the model's `block_bytes`)."""
        if cfg.kv_transfer_role is None:
            return None
        transfer = KVTransfer(block_bytes, cfg.kv_transfer_gbps, cfg.kv_transfer_latency)
        return cls(cfg.kv_transfer_role, transfer, cfg.kv_lease_duration)

    def requests(self, requests: Iterable[Request]) -> list[Request]:
        """The workload as the proxy sends it to this side: one output token each on the prefill
        side (`with_max_tokens_one`, as kvsim's `simulate` does); parallel sampling is refused."""
        out = list(requests)
        many = next((r for r in out if r.n > 1), None)
        if many is not None:
            raise ConfigError(f"request {many.id!r} has n = {many.n}: kvsim conforms P/D disaggregation for "
                              "requests of one sample")
        return [with_max_tokens_one(r) for r in out] if self.role == "prefill" else out

    def extra_config(self) -> dict[str, Any]:
        """The NixlConnector's `kv_connector_extra_config` for kvsim's lease."""
        return {"kv_lease_duration": self.lease_s}

    def params(self, req: Request, block_size: int) -> dict[str, Any]:
        """The kv_transfer_params `req` reaches this side with (a fresh dict: vLLM updates it)."""
        if self.role == "prefill":
            return {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                    "remote_block_ids": None, "remote_host": None, "remote_port": None}
        blocks = -(-req.prompt_len // block_size)
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [list(range(1, blocks + 1))],
                "remote_request_id": f"prefill-{req.id}", "remote_num_tokens": req.prompt_len,
                "remote_blocks_expiry_time": None, "remote_registration_generation": 0, "transfer_mode": "pull",
                **REMOTE}

    def worker(self, sched: Any, block_size: int) -> NixlWorker:
        """The fake worker for vLLM's scheduler `sched`, once its connector is checked to be the pull
        NIXL connector with kvsim's lease."""
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
            NixlPullConnectorScheduler,
        )
        from vllm.v1.kv_cache_interface import MambaSpec

        side = getattr(sched.connector, "connector_scheduler", None)
        if not isinstance(side, NixlPullConnectorScheduler) or side._kv_lease_duration != self.lease_s:
            raise RuntimeError(f"vLLM built {type(side).__name__} for its connector, not the NIXL pull "
                               f"connector's scheduler side with a {self.lease_s:g} s lease")
        groups = sched.kv_cache_config.kv_cache_groups
        mamba = frozenset(g for g, group in enumerate(groups) if isinstance(group.kv_cache_spec, MambaSpec))
        return NixlWorker(self, sched, block_size, mamba)

    @property
    def run_class(self) -> type[_NixlRun]:
        """The cost-clock run that hands each step to the fake worker (`sim.conform.vllm_timed`)."""
        return _NixlRun


class NixlWorker:
    """vLLM's NIXL pull worker (pull_worker.py) as its scheduler side sees it, with kvsim's timing
    (see the module docstring): reads and sends in flight, and what each step's poll reports."""

    def __init__(self, nixl: Nixl, sched: Any, block_size: int, mamba_groups: frozenset[int] = frozenset()):
        self.nixl, self.sched, self.block_size = nixl, sched, block_size
        self.mamba_groups = mamba_groups  # vLLM's groups of MambaSpec: their blocks are state blocks
        self.reads: dict[str, float] = {}  # decode side: request -> when its read is done
        self.sends: dict[str, float] = {}  # prefill side: request -> when the decode side has read it
        self.finished_at: dict[str, float] = {}  # prefill side: request -> when vLLM finished it

    def params(self, req: Request) -> dict[str, Any]:
        return self.nixl.params(req, self.block_size)

    def poll(self, meta: Any, start: float) -> tuple[_OrderedIds, _OrderedIds]:
        """Step `meta` (NixlConnectorMetadata) starts at `start`: its reads start, its finished
        requests' sends are timed; the reads and sends done by `start` (finished_recving,
        finished_sending), each in the order they were handed over."""
        transfer = self.nixl.transfer
        for rid, req in meta.reqs_to_recv.items():  # every group's blocks, each at its kind's bytes
            if not req.awaiting_kvs and not any(req.local_block_ids):  # a full local hit: a notice, never
                continue  # reported (pull_worker.py `start_load_kv`; the scheduler asserts it)
            self.reads[rid] = start + transfer.seconds(*self._kinds(map(len, req.local_block_ids)))
        for rid in meta.reqs_to_send:
            self.sends[rid] = self.finished_at.pop(rid) + min(transfer.seconds(*self._offered(rid)), self.nixl.lease_s)
        return self._done(self.reads, start), self._done(self.sends, start)

    def _kinds(self, counts: Iterable[int]) -> tuple[int, int]:
        """(attention blocks, Mamba state blocks) of blocks counted group by group in vLLM's group order."""
        blocks = states = 0
        for g, n in enumerate(counts):
            if g in self.mamba_groups:
                states += n
            else:
                blocks += n
        return blocks, states

    def _offered(self, rid: str) -> tuple[int, int]:
        """The blocks the prefill side's `request_finished` offers for `rid` (the remote_block_ids it
        returns: vLLM's block ids of the computed tokens, clipped by its own
        `get_exchange_clipped_blocks`), null blocks not counted: the decode side reads them; as
        (attention blocks, Mamba state blocks)."""
        manager = self.sched.kv_cache_manager
        ids = manager.get_block_ids_for_computed_tokens(rid, self.sched.requests[rid].num_computed_tokens)
        null = manager.block_pool.null_block.block_id
        clipped = self.sched.connector.connector_scheduler.get_exchange_clipped_blocks(ids)
        return self._kinds(sum(1 for b in group if b != null) for group in clipped)

    @staticmethod
    def _done(inflight: dict[str, float], start: float) -> _OrderedIds:
        done = _OrderedIds()
        for rid in [rid for rid, t in inflight.items() if t <= start]:
            del inflight[rid]
            done.add(rid)
        return done

    def step_ended(self, end: float) -> None:
        """Reads start with their step, not at its end."""

    def busy_until(self, now: float) -> float | None:
        """After an empty step at `now`: when the next read or send is done; None if none is in flight."""
        return min([*self.reads.values(), *self.sends.values()], default=None)


class _NixlRun(_TimedRun):
    """The cost-clock loop of `sim.conform.vllm_timed` with the NIXL fake worker: requests carry the
    proxy's kv_transfer_params, each step is polled as it starts, finishes are timed for the sends."""

    worker: NixlWorker

    def _transfer_params(self, req: Request) -> dict[str, Any] | None:
        return self.worker.params(req)

    def _handed(self, out: Any, start: float) -> tuple[Any, bool]:
        from vllm.v1.outputs import KVConnectorOutput

        recving, sending = self.worker.poll(out.kv_connector_metadata, start)
        return KVConnectorOutput(finished_recving=recving or None, finished_sending=sending or None), \
            bool(recving or sending)

    def _ended(self, end: float) -> None:
        self.worker.step_ended(end)

    def _finished(self, ids: Iterable[str], step: int, now: float) -> None:
        ids = list(ids)
        for rid in ids if self.worker.nixl.role == "prefill" else ():
            if self.recs[rid]["finish_step"] == step and rid in self.parent:
                self.worker.finished_at[rid] = now
        super()._finished(ids, step, now)
