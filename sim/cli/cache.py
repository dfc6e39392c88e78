"""`kvsim cache-replay`: drive the block manager alone, no time model."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TextIO

import typer

from kvcache.eviction import POLICIES, check_policy
from kvcache.profiles import DEFAULT_VERSION
from sim.cli.common import fail, open_workload, staged_file
from workloads.names import FORMATS

if TYPE_CHECKING:
    from kvcache.manager import KVCacheManager
    from kvcache.replay import ReplayRecord, ReplayResult
    from workloads.request import Workload


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
) -> None:
    """Replay a workload through the block manager and report its prefix-cache hit rate."""
    from sim.engine.config import check_block_size

    try:
        check_block_size(block_size)
        check_policy(eviction)
    except ValueError as e:
        raise fail(str(e)) from None
    if num_blocks < 2:
        raise fail(f"--num-blocks must be at least 2 (block 0 is reserved), got {num_blocks}")
    if max_running < 1:
        raise fail(f"--max-running must be >= 1, got {max_running}")
    from kvcache.manager import KVCacheManager
    from workloads.default import DEFAULT_SEED
    from workloads.errors import WorkloadError

    try:
        wl = open_workload(workload, format, skip_bad, DEFAULT_SEED)
        manager = KVCacheManager(num_blocks, block_size, eviction=eviction, track_ids=False,
                                 vllm_version=vllm_version)
    except (WorkloadError, ValueError) as e:
        raise fail(str(e)) from None
    with contextlib.ExitStack() as stack:
        sink = open(stack.enter_context(staged_file(out)), "w") if out else None
        if sink:
            stack.callback(sink.close)
        result, wall = _replay(wl, manager, max_running, sink)
    skipped = getattr(wl, "skipped", 0)
    if skipped:
        typer.echo(f"skipped {skipped} bad lines", err=True)
    summary = result.as_dict()
    if as_json:
        typer.echo(json.dumps(summary))
        return
    name = "default workload" if workload is None else str(workload)
    typer.echo(f"cache replay of {name}: block size {block_size}, {num_blocks:,} blocks, "
               f"eviction {eviction}, max running {max_running}, vLLM {manager.profile.version} rules")
    typer.echo(f"requests       {result.requests:,} ({result.rejected:,} rejected, {result.truncated:,} truncated, "
               f"{result.preemptions:,} preemptions)")
    typer.echo(f"prompt tokens  {result.prompt_tokens:,}")
    typer.echo(f"hit tokens     {result.hit_tokens:,}  ({result.hit_rate:.2%})")
    typer.echo(f"evicted blocks {result.evicted_blocks:,}")
    typer.echo(f"wall time      {wall:.2f} s ({result.requests / wall:,.0f} requests/s)")


def _replay(wl: Workload, manager: KVCacheManager, max_running: int, sink: TextIO | None
            ) -> tuple[ReplayResult, float]:
    """The replay's counts and its wall time; one JSON line a request to `sink` if given."""
    from kvcache.replay import replay
    from workloads.errors import WorkloadError

    def on_record(rec: ReplayRecord) -> None:
        if sink:
            sink.write(json.dumps({
                "id": rec.id, "prompt_tokens": rec.prompt_tokens, "hit_tokens": rec.hit_tokens,
                "output_tokens": rec.output_tokens, "status": rec.status, "preemptions": rec.preemptions,
            }) + "\n")

    t0 = time.perf_counter()
    try:
        result = replay(wl, manager, max_running, on_record)
    except WorkloadError as e:
        raise fail(str(e)) from None
    return result, time.perf_counter() - t0


def register(app: typer.Typer) -> None:
    app.command("cache-replay")(cache_replay)

