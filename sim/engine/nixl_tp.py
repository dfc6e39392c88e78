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
"""

from __future__ import annotations

from dataclasses import dataclass

from kvsim.sim.engine.catalog import ConfigError


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
