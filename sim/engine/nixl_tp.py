"""What a NIXL read moves per rank when the prefill and decode replicas run at different tensor-parallel
sizes: vLLM 0.33's TP mapping (vllm/distributed/kv_transfer/kv_connector/v1/nixl/tp_mapping.py
`compute_tp_mapping`, `compute_head_offset`; vllm/distributed/kv_transfer/kv_connector/utils.py
`TransferTopology.tp_ratio`).

Every decode rank reads exactly the KV it holds (its own heads; MLA's latent whole), so a decode
rank's NIC takes one decode rank's share of each block. Which prefill ranks serve it:

- decode TP >= prefill TP (`tp_ratio` > 0): decode rank r reads from prefill rank r // ratio alone,
  so each prefill rank serves `ratio` decode ranks and its NIC sends `ratio` x a decode rank's share
  (its own share when the decode ranks split its heads; more when they replicate heads, TP above the
  KV heads, or for MLA, whose every rank reads the whole latent);
- decode TP < prefill TP: decode rank r reads from the prefill ranks r x ratio .. (r + 1) x ratio - 1
  that hold distinct heads (duplicates skipped); each sends its own share of the block (MLA: rank
  r x ratio alone, the whole latent).

Either way one side's rank NIC carries the most, and ranks work in parallel, so a read alone takes
blocks x max(send, receive) / a rank's bandwidth (`sim.cluster.link.SharedLink` shares NICs with
these per-rank bytes). vLLM needs one TP size to divide the other (`tp_ratio`'s assertions).

Mamba state (a hybrid model's state blocks) maps the same way with its own bytes: it is always split
across ranks, never replicated (nixl/base_worker.py `_build_mamba_remote`; tp_mapping.py
`compute_tp_mapping`'s SSM source ranks). Decode TP >= prefill TP: decode rank r reads its slice of
each conv sub-projection and of the SSM state from prefill rank r // ratio, which sends `ratio` x a
decode rank's state (its own); decode TP < prefill TP: decode rank r reads every one of prefill ranks
r x ratio .. (r + 1) x ratio - 1's whole state (ssm_conv_transfer_utils.py `remote_conv_offsets` with
a negative ratio). A read of attention and state blocks sums both kinds on each side (`ReadRanks`).

A Mamba hybrid's block size depends on its TP (vLLM raises it until an attention page holds a rank's
state), so two pools at different TP sizes may differ in it: vLLM's decode side needs its block size a
multiple of the prefill side's (kv_connector/utils.py `TransferTopology.block_size_ratio`'s assertion),
and reads a decode block's tokens from that many prefill blocks; other pairings are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvsim.sim.engine.catalog import ConfigError

if TYPE_CHECKING:
    from kvsim.sim.engine.nixl import BlockBytes


@dataclass(frozen=True, slots=True)
class RankBytes:
    """Bytes one block of a read puts through one prefill rank's NIC (`send`) and one decode rank's
    (`receive`), the busiest rank of each side."""

    send: int
    receive: int


def check_tp_pair(prefill_tp: int, decode_tp: int) -> None:
    """Raise ConfigError unless one TP size divides the other, as vLLM's `TransferTopology.tp_ratio`
    asserts."""
    big, small = max(prefill_tp, decode_tp), min(prefill_tp, decode_tp)
    if small < 1 or big % small:
        raise ConfigError(f"decode_pool/prefill_pool: tensor_parallel {decode_tp} (decode) and {prefill_tp} (prefill) "
                          "must divide one another (vLLM's NIXL TransferTopology.tp_ratio)")


def rank_bytes(prefill_tp: int, prefill_block_bytes: int, decode_tp: int, decode_block_bytes: int) -> RankBytes:
    """The per-rank bytes of one block read from a prefill replica at TP `prefill_tp`, whose rank holds
    `prefill_block_bytes` of a block, by a decode replica at `decode_tp`, whose rank holds
    `decode_block_bytes` of it."""
    check_tp_pair(prefill_tp, decode_tp)
    if decode_tp >= prefill_tp:
        return RankBytes(decode_tp // prefill_tp * decode_block_bytes, decode_block_bytes)
    return RankBytes(prefill_block_bytes, decode_block_bytes)


@dataclass(frozen=True, slots=True)
class ReadRanks:
    """The per-rank bytes of one block of each kind a read between two pools moves: an attention block
    (`block`) and a Mamba group's state block (`state`: nothing without Mamba state)."""

    block: RankBytes
    state: RankBytes = RankBytes(0, 0)

    def of(self, blocks: int, states: int) -> RankBytes:
        """The busiest prefill rank's and decode rank's bytes of a read of `blocks` attention blocks
        and `states` state blocks."""
        return RankBytes(blocks * self.block.send + states * self.state.send,
                         blocks * self.block.receive + states * self.state.receive)


def read_ranks(prefill_tp: int, prefill: BlockBytes, prefill_block_size: int,
               decode_tp: int, decode: BlockBytes, decode_block_size: int) -> ReadRanks:
    """The per-rank bytes of a read from a prefill pool at TP `prefill_tp` (its `BlockBytes`, blocks of
    `prefill_block_size` tokens) by a decode pool at `decode_tp`, per decode block: ConfigError unless
    the decode block size is a multiple of the prefill one (see the module docstring)."""
    if decode_block_size % prefill_block_size:
        raise ConfigError(f"decode_pool/prefill_pool: blocks of {decode_block_size} tokens on the decode side (TP "
                          f"{decode_tp}) and {prefill_block_size} on the prefill side (TP {prefill_tp}): vLLM's NIXL "
                          "connector needs the decode block size a multiple of the prefill one "
                          "(kv_connector/utils.py TransferTopology.block_size_ratio)")
    per_decode_block = prefill.attention * (decode_block_size // prefill_block_size)
    block = rank_bytes(prefill_tp, per_decode_block, decode_tp, decode.attention)
    if not (prefill.state_groups or decode.state_groups):
        return ReadRanks(block)
    return ReadRanks(block, rank_bytes(prefill_tp, prefill.state, decode_tp, decode.state))
