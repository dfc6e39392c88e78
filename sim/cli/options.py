"""Options that several commands take, defined once so they are named, described and validated
alike: the model and hardware (`run`, `cache-replay`, `curve`), vLLM's admission knobs (`run`,
`conform`) and KV offloading's knobs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import typer

from kvsim.kvcache.eviction import POLICIES
from kvsim.sim.cli.common import fail
from kvsim.sim.engine.catalog import GPUS, MODELS
from kvsim.sim.engine.hf_config import catalog_names

DEFAULT_MODEL, DEFAULT_GPU = "llama-3-8b", "h100-sxm"  # SimConfig's (tests/sim/cli: checked against it)

Model = Annotated[str | None, typer.Option(
    help=f"model: {', '.join([*MODELS, *catalog_names()])}, or a Hugging Face config.json [default: {DEFAULT_MODEL}]")]
Gpu = Annotated[str | None, typer.Option(help=f"GPU: {'|'.join(GPUS)}, or a GPU file (.toml) [default: {DEFAULT_GPU}]")]
Tp = Annotated[int | None, typer.Option("--tp", help="tensor-parallel degree (GPUs one replica spans) [default: 1]")]
Eviction = Annotated[str | None, typer.Option(help=f"eviction policy of the prefix cache: {'|'.join(POLICIES)} [default: lru]")]
BlockSize = Annotated[int | None, typer.Option(help="tokens per KV block, a power of two [default: 16]")]
KvOffloadingSize = Annotated[float | None, typer.Option(
    "--kv-offloading-size", help="GiB of host memory for offloaded KV, as vLLM's (off by default)")]
OffloadEvictionPolicy = Annotated[str | None, typer.Option(help="host tier eviction: lru|arc")]
OffloadStoreThreshold = Annotated[int | None, typer.Option(
    help="store a chunk once offered this often (< 2: always)")]
OffloadBlocksPerChunk = Annotated[int | None, typer.Option(help="GPU blocks an offloaded chunk holds")]
OffloadAll = Annotated[bool, typer.Option(
    "--offload-all", help="offload decode chunks too (vLLM offload_prompt_only=false)")]
OffloadFs = Annotated[bool, typer.Option(
    "--offload-fs", help="a file-system tier below the host tier (vLLM's tiering `fs` secondary tier)")]
OffloadFsSize = Annotated[float | None, typer.Option(help="GiB of disk for the file tier (default: unbounded, as vLLM)")]
OffloadFsGbps = Annotated[float | None, typer.Option(help="GB/s one file-tier I/O thread reads or writes [2]")]
OffloadFsThreads = Annotated[int | None, typer.Option(help="file-tier read threads, and write threads [16]")]

MaxNumActiveSeqs = Annotated[int | None, typer.Option(
    help="most requests admitted into RUNNING, at most max_num_seqs (vLLM 0.31+)")]
LongPrefillAdaptive = Annotated[bool, typer.Option(
    "--long-prefill-token-threshold-adaptive",
    help="floor the long-prefill cap at the token budget / requests running and waiting (vLLM 0.31+)")]
NoReserveFullIsl = Annotated[bool, typer.Option(
    "--no-scheduler-reserve-full-isl", help="admit a request once its chunk fits, not its whole known context")]
PrefillScheduleInterval = Annotated[int | None, typer.Option(
    help="prefill only once every N executed steps while requests decode (vLLM 0.33)")]
MaxNumScheduledTokens = Annotated[int | None, typer.Option(
    help="a step's token budget, at most max_num_batched_tokens (default: the latter)")]

KvTransferRole = Annotated[str | None, typer.Option(
    help="P/D disaggregation, this replica standing alone in one role with vLLM's NixlConnector: decode (each "
         "prompt's KV read from a prefill side) | prefill (one token a request, its blocks held until read)")]
KvTransferGbps = Annotated[float | None, typer.Option(help="GB/s a GPU's NIC reads KV at (P/D) [default: 25]")]
KvTransferLatency = Annotated[float | None, typer.Option(help="seconds each KV read takes besides its bytes (P/D) [default: 5e-05]")]
KvLeaseDuration = Annotated[float | None, typer.Option(
    help="seconds the prefill side holds a finished request's blocks at most (vLLM's kv_lease_duration) [default: 30]")]


def transfer_changes(kv_transfer_role: str | None, kv_transfer_gbps: float | None, kv_transfer_latency: float | None,
                     kv_lease_duration: float | None) -> dict[str, Any]:
    """The `SimConfig` fields the P/D options given set (`SimConfig.validate` checks them)."""
    given = {"kv_transfer_role": kv_transfer_role, "kv_transfer_gbps": kv_transfer_gbps,
             "kv_transfer_latency": kv_transfer_latency, "kv_lease_duration": kv_lease_duration}
    return {k: v for k, v in given.items() if v is not None}


def admission_changes(max_num_active_seqs: int | None, long_prefill_adaptive: bool,
                      no_reserve_full_isl: bool, prefill_schedule_interval: int | None = None,
                      max_num_scheduled_tokens: int | None = None) -> dict[str, Any]:
    """The `SimConfig` fields the admission options given set."""
    given = {"max_num_active_seqs": max_num_active_seqs, "prefill_schedule_interval": prefill_schedule_interval,
             "max_num_scheduled_tokens": max_num_scheduled_tokens}
    changes: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
    if long_prefill_adaptive:
        changes["long_prefill_token_threshold_adaptive"] = True
    if no_reserve_full_isl:
        changes["scheduler_reserve_full_isl"] = False
    return changes


def offload_changes(kv_offloading_size: float | None, offload_eviction_policy: str | None,
                    offload_store_threshold: int | None, offload_blocks_per_chunk: int | None,
                    offload_all: bool) -> dict[str, Any]:
    """The `SimConfig` fields the offloading options given set (`SimConfig.validate` checks them); the
    host tier's options without `--kv-offloading-size` fail (they would change nothing, silently)."""
    given = {"kv_offloading_size": kv_offloading_size, "offload_eviction_policy": offload_eviction_policy,
             "offload_store_threshold": offload_store_threshold,
             "offload_blocks_per_chunk": offload_blocks_per_chunk}
    tier = [k for k, v in given.items() if v is not None and k != "kv_offloading_size"] + \
        (["offload_all"] if offload_all else [])
    if tier and kv_offloading_size is None:
        raise fail(f"--{tier[0].replace('_', '-')}: a KV offloading option, and no host tier is given: give "
                   "--kv-offloading-size GiB, or leave it out")
    changes = {k: v for k, v in given.items() if v is not None}
    if offload_all:
        changes["offload_prompt_only"] = False
    return changes


def fs_changes(offload_fs: bool, offload_fs_size: float | None, offload_fs_gbps: float | None,
               offload_fs_threads: int | None) -> dict[str, Any]:
    """The `SimConfig` fields the file-tier options given set; one without `--offload-fs` fails."""
    given = {"offload_fs_size": offload_fs_size, "offload_fs_gbps": offload_fs_gbps,
             "offload_fs_threads": offload_fs_threads}
    tier = [k for k, v in given.items() if v is not None]
    if tier and not offload_fs:
        raise fail(f"--{tier[0].replace('_', '-')}: the file tier's option, and no file tier is given: give "
                   "--offload-fs, or leave it out")
    return {k: v for k, v in given.items() if v is not None} | ({"offload_fs": True} if offload_fs else {})


def hardware_changes(model: str | None, gpu: str | None, tp: int | None) -> dict[str, Any]:
    """The `SimConfig` fields --model, --gpu and --tp set, those given."""
    given = {"model": model, "gpu": gpu, "tensor_parallel": tp}
    return {k: v for k, v in given.items() if v is not None}


RetentionInterval = Annotated[str | None, typer.Option(
    "--prefix-cache-retention-interval",
    help="vLLM's option: which of a sliding window's full blocks are hashed for the prefix cache: 0 (vLLM 0.33's "
         "default) only the tail a later request can resume from, N (a multiple of the block size) also a tail "
         "every N tokens, none every block [default: 0]")]


AsyncScheduling = Annotated[bool | None, typer.Option(
    "--async-scheduling/--no-async-scheduling",
    help="vLLM's async scheduling: batch k+1 is scheduled while batch k runs; --no-... runs vLLM's step-by-step "
         "scheduler [default: as `vllm serve` 0.33 decides: async, except where kvsim models only sync (swap "
         "preemption, lookahead slots, forked samples, releases before 0.33)]")]
DisableHybrid = Annotated[bool | None, typer.Option(
    "--disable-hybrid-kv-cache-manager/--no-disable-hybrid-kv-cache-manager",
    help="vLLM's flag, for a model mixing layer kinds: off keeps every layer's every token in one group; "
         "--no-... asks for vLLM's hybrid KV-cache groups [default: as vLLM on a CUDA host decides: the groups, "
         "except with chunked local attention]")]
HybridChunkedLocal = Annotated[bool, typer.Option(
    "--hybrid-chunked-local",
    help="vLLM's VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1: hybrid groups for chunked local attention too")]


def hybrid_changes(disable: bool | None, chunked_local: bool) -> dict[str, Any]:
    """The SimConfig fields the hybrid KV-cache manager's two options set."""
    out: dict[str, Any] = {} if disable is None else {"disable_hybrid_kv_cache_manager": disable}
    return {**out, "hybrid_chunked_local": True} if chunked_local else out


def none_or_number(value: str | None, field: str, parse: Callable[[str], Any] = int, what: str = "a number of tokens") -> dict[str, Any]:
    """The SimConfig `field` a none-or-number option sets (`--` + the field with dashes): `parse`d, or
    None for 'none'; not given: no change; anything else: exit 2 with the one-line error."""
    from kvsim.sim.cli.common import fail

    if value is None:
        return {}
    text = value.strip().lower()
    if text == "none":
        return {field: None}
    try:
        return {field: parse(text)}
    except ValueError:
        raise fail(f"--{field.replace('_', '-')}: expected {what} or none, got {value!r}") from None


def retention_changes(value: str | None) -> dict[str, Any]:
    """The SimConfig field `--prefix-cache-retention-interval` sets: a token count, or none."""
    return none_or_number(value, "prefix_cache_retention_interval")

