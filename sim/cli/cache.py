"""`kvsim cache-replay`: drive the block manager alone, no time model."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TextIO

import typer

from kvsim.kvcache.eviction import POLICIES, check_policy
from kvsim.kvcache.profiles import DEFAULT_VERSION
from kvsim.sim.cli.common import fail, open_workload, staged_file
from kvsim.sim.cli.options import (
    DisableHybrid,
    HybridChunkedLocal,
    KvOffloadingSize,
    Model,
    OffloadAll,
    OffloadBlocksPerChunk,
    OffloadEvictionPolicy,
    OffloadStoreThreshold,
    RetentionInterval,
    Tp,
    hardware_changes,
    hybrid_changes,
    offload_changes,
    retention_changes,
)
from kvsim.workloads.names import FORMATS

if TYPE_CHECKING:
    from kvsim.kvcache.manager import KVCacheManager
    from kvsim.kvcache.replay import Offload, ReplayRecord, ReplayResult
    from kvsim.workloads.request import Workload


def cache_replay(
    workload: Annotated[Path | None, typer.Argument(help="workload file (any `kvsim workload` format); default: the embedded workload")] = None,
    block_size: Annotated[int, typer.Option("--block-size", "-b", help="tokens per block")] = 16,
    num_blocks: Annotated[int, typer.Option("--num-blocks", "-n", help="GPU blocks as vLLM reports them (block 0 is reserved)")] = 10_000,
    max_running: Annotated[int, typer.Option("--max-running", "-k", help="1: sequential; K > 1: concurrent steps")] = 1,
    eviction: Annotated[str, typer.Option("--eviction", "-e", help="|".join(POLICIES))] = "lru",
    format: Annotated[str, typer.Option("--format", "-f", help="|".join(FORMATS))] = "auto",
    out: Annotated[Path | None, typer.Option("--out", "-o", help="write one JSON line per request here")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the summary as one JSON object")] = False,
    skip_bad: Annotated[bool, typer.Option("--skip-bad", help="skip bad lines (and report how many)")] = False,
    vllm_version: Annotated[str, typer.Option("--vllm-version", help="vLLM release whose rules to follow, 0.23-0.33")] = DEFAULT_VERSION,
    model: Model = None,
    tp: Tp = None,
    kv_offloading_size: KvOffloadingSize = None,
    offload_eviction_policy: OffloadEvictionPolicy = None,
    offload_store_threshold: OffloadStoreThreshold = None,
    offload_blocks_per_chunk: OffloadBlocksPerChunk = None,
    offload_all: OffloadAll = False,
    disable_hybrid_kv_cache_manager: DisableHybrid = None,
    hybrid_chunked_local: HybridChunkedLocal = False,
    prefix_cache_retention_interval: RetentionInterval = None,
) -> None:
    """Replay a workload through the block manager and report its prefix-cache hit rate
    (with --kv-offloading-size, over a host tier with instantaneous transfers; with --model, in the
    model's KV-cache groups where vLLM keeps it in several)."""
    from kvsim.sim.engine.config import check_block_size

    offload = None
    try:
        check_block_size(block_size)
        check_policy(eviction)
        changes = {**hardware_changes(model, None, tp), **offload_changes(
            kv_offloading_size, offload_eviction_policy, offload_store_threshold, offload_blocks_per_chunk, offload_all)}
        if changes:  # checked as `kvsim run` checks them; the model's KV bytes size the tier's chunks
            offload = _offload(changes, block_size, vllm_version)
    except ValueError as e:
        raise fail(str(e)) from None
    if num_blocks < 2:
        raise fail(f"--num-blocks must be at least 2 (block 0 is reserved), got {num_blocks}")
    if max_running < 1:
        raise fail(f"--max-running must be >= 1, got {max_running}")
    from kvsim.sim.engine.config import SimConfig
    from kvsim.sim.engine.run import replay_manager
    from kvsim.workloads.default import DEFAULT_SEED
    from kvsim.workloads.errors import WorkloadError

    try:
        wl = open_workload(workload, format, skip_bad, DEFAULT_SEED)
        # a model mixing layer kinds replays in vLLM's hybrid KV-cache groups, as `kvsim run` runs it
        cfg = SimConfig(block_size=block_size, eviction=eviction, vllm_version=vllm_version).replace(
            **hardware_changes(model, None, tp), **({"kv_offloading_size": kv_offloading_size} if offload else {}),
            **hybrid_changes(disable_hybrid_kv_cache_manager, hybrid_chunked_local),
            **retention_changes(prefix_cache_retention_interval))
        manager = replay_manager(cfg, num_blocks)
    except (WorkloadError, ValueError) as e:
        raise fail(str(e)) from None
    with contextlib.ExitStack() as stack:
        sink = open(stack.enter_context(staged_file(out)), "w") if out else None
        if sink:
            stack.callback(sink.close)
        result, wall = _replay(wl, manager, max_running, sink, offload)
    skipped = getattr(wl, "skipped", 0)
    if skipped:
        typer.echo(f"skipped {skipped} bad lines", err=True)
    summary = result.as_dict()
    if as_json:
        typer.echo(json.dumps(summary))
        return
    name = "default workload" if workload is None else str(workload)
    kinds: dict[str, int] = {}
    for g in getattr(manager, "groups", ()):
        kinds[g.describe()] = kinds.get(g.describe(), 0) + 1
    groups = (f", {manager.num_groups} KV-cache groups ({', '.join(f'{n} {k}' for k, n in kinds.items())})"
              if manager.num_groups > 1 else "")
    typer.echo(f"cache replay of {name}: block size {manager.block_size}, {num_blocks:,} blocks{groups}, "
               f"eviction {eviction}, max running {max_running}, vLLM {manager.profile.version} rules")
    typer.echo(f"requests       {result.requests:,} ({result.rejected:,} rejected, {result.truncated:,} truncated, "
               f"{result.preemptions:,} preemptions)")
    typer.echo(f"prompt tokens  {result.prompt_tokens:,}")
    typer.echo(f"hit tokens     {result.hit_tokens:,}  ({result.hit_rate:.2%})")
    typer.echo(f"evicted blocks {result.evicted_blocks:,}")
    if offload is not None:
        typer.echo(f"host tier      {result.host_chunks:,} chunks of {offload.blocks_per_chunk} blocks: "
                   f"{result.offload_hit_tokens:,} hit tokens, total hit rate {result.total_hit_rate:.2%}")
        typer.echo(f"               {result.stored_blocks:,} blocks stored, {result.loaded_blocks:,} loaded, "
                   f"{result.offload_evictions:,} chunks evicted")
    typer.echo(f"wall time      {wall:.2f} s ({result.requests / wall:,.0f} requests/s)")


def _offload(changes: dict, block_size: int, vllm_version: str) -> Offload | None:
    """The host tier the options ask for (None: --kv-offloading-size not given); raises
    ValueError (ConfigError) for a bad knob, as `kvsim run` words it."""
    from kvsim.sim.engine.config import SimConfig
    from kvsim.sim.studies.curves import replay_offload

    cfg = SimConfig(block_size=block_size, vllm_version=vllm_version).replace(**changes).validate()
    return replay_offload(cfg)


def _replay(wl: Workload, manager: KVCacheManager, max_running: int, sink: TextIO | None,
            offload: Offload | None = None) -> tuple[ReplayResult, float]:
    """The replay's counts and its wall time; one JSON line a request to `sink` if given."""
    from kvsim.kvcache.replay import OffloadRecord, replay
    from kvsim.workloads.errors import WorkloadError

    def on_record(rec: ReplayRecord) -> None:
        if sink:
            line = {
                "id": rec.id, "prompt_tokens": rec.prompt_tokens, "hit_tokens": rec.hit_tokens,
                "output_tokens": rec.output_tokens, "status": rec.status, "preemptions": rec.preemptions,
            }
            if isinstance(rec, OffloadRecord):  # the replay has a host tier
                line["offload_hit_tokens"] = rec.offload_hit_tokens
            sink.write(json.dumps(line) + "\n")

    t0 = time.perf_counter()
    try:
        result = replay(wl, manager, max_running, on_record, offload)
    except WorkloadError as e:
        raise fail(str(e)) from None
    return result, time.perf_counter() - t0


def register(app: typer.Typer) -> None:
    app.command("cache-replay")(cache_replay)

