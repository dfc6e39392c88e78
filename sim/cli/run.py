"""`kvsim run`: simulate a workload and write a run folder; mounts `report` and `compare` too."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from sim.cli.common import fail, open_workload
from sim.cli.report import compare, format_summary, report
from workloads.names import FORMATS

if TYPE_CHECKING:
    from sim.engine.config import SimConfig
    from workloads.request import Workload

RUNS_DIR = Path("runs")


def run_name(workload: str, cfg: SimConfig) -> str:
    """A deterministic folder name: workload, model, GPU, TP, block size and a config digest."""
    digest = hashlib.sha256(json.dumps([workload, cfg.to_dict()], sort_keys=True).encode()).hexdigest()
    stem = Path(workload).stem if workload != "default" else "default"
    return f"{stem}-{cfg.model}-{cfg.gpu}-tp{cfg.tensor_parallel}-bs{cfg.block_size}-{digest[:8]}"


def _progress_bar(workload: Workload):
    """A rich progress bar on stderr (requests done), or None when stderr is not a terminal."""
    if not sys.stderr.isatty():
        return None, None
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    total = sum(1 for _ in workload)  # one cheap pass (prompts stay lazy) for the bar's total
    bar = Progress(TextColumn("simulating"), BarColumn(), MofNCompleteColumn(), TextColumn("requests"),
                   TimeElapsedColumn(), console=Console(stderr=True), transient=True)
    task = bar.add_task("run", total=total)
    return bar, lambda n: bar.update(task, completed=n)


def _smallest_drop(result: Any) -> str:
    rq = result.requests
    dropped = rq[rq["reason"].isin(["prompt_exceeds_cache", "context_exceeds_cache"])]
    return f"{int(dropped['prompt_tokens'].min()):,}" if len(dropped) else "?"


def run(
    workload: Annotated[Path | None, typer.Argument(help="workload file or RAGPulse folder; default: the embedded workload")] = None,
    format: Annotated[str, typer.Option("--format", "-f", help="|".join(FORMATS))] = "auto",
    skip_bad: Annotated[bool, typer.Option("--skip-bad", help="skip bad trace lines (and count them)")] = False,
    model: Annotated[str | None, typer.Option(help="model name (see sim.engine.catalog)")] = None,
    gpu: Annotated[str | None, typer.Option(help="GPU name (see sim.engine.catalog)")] = None,
    tp: Annotated[int | None, typer.Option("--tp", help="tensor-parallel degree")] = None,
    block_size: Annotated[int | None, typer.Option(help="tokens per KV block (power of two)")] = None,
    num_gpu_blocks: Annotated[int | None, typer.Option(help="KV blocks (default: derived from GPU memory)")] = None,
    gpu_memory_utilization: Annotated[float | None, typer.Option(help="fraction of GPU memory vLLM may use")] = None,
    num_cpu_blocks: Annotated[int | None, typer.Option(help="CPU swap blocks")] = None,
    eviction: Annotated[str | None, typer.Option(help="eviction policy of the prefix cache")] = None,
    watermark: Annotated[float | None, typer.Option(help="fraction of blocks kept free at admission")] = None,
    no_prefix_caching: Annotated[bool, typer.Option("--no-prefix-caching", help="disable prefix caching")] = False,
    preemption: Annotated[str | None, typer.Option(help="recompute|swap")] = None,
    scheduling: Annotated[str | None, typer.Option(help="fcfs|priority")] = None,
    defrag_threshold: Annotated[int | None, typer.Option(help="run the online defragmenter past this id gap")] = None,
    max_num_seqs: Annotated[int | None, typer.Option(help="most sequences per step")] = None,
    load: Annotated[float | None, typer.Option(help="arrival-rate multiplier (2: arrivals twice as dense)")] = None,
    max_num_batched_tokens: Annotated[int | None, typer.Option(help="token budget per step")] = None,
    no_chunked_prefill: Annotated[bool, typer.Option("--no-chunked-prefill", help="a prompt must fit one step")] = False,
    max_model_len: Annotated[int | None, typer.Option(help="tokens per sequence, as vLLM's --max-model-len (default: no limit)")] = None,
    long_prefill_token_threshold: Annotated[int | None, typer.Option(help="most prefill tokens of one request per step (0: no cap)")] = None,
    vllm_version: Annotated[str | None, typer.Option("--vllm-version", help="vLLM release whose rules to follow, 0.23-0.33 (default 0.33)")] = None,
    step_time: Annotated[float | None, typer.Option("--step-time", help="every step takes exactly this many seconds, on a grid (no cost model)")] = None,
    async_scheduling: Annotated[bool, typer.Option("--async-scheduling", help="vLLM's async scheduling: batch k+1 is scheduled while batch k runs")] = False,
    calibration: Annotated[Path | None, typer.Option(help="calibration profile (JSON) from `kvsim calibrate`")] = None,
    slo_ttft: Annotated[float | None, typer.Option(help="TTFT SLO for goodput, seconds")] = None,
    slo_tpot: Annotated[float | None, typer.Option(help="TPOT SLO for goodput, seconds")] = None,
    record_ops: Annotated[bool, typer.Option("--record-ops", help="write the block-op stream (ops.parquet)")] = False,
    debug_invariants: Annotated[bool, typer.Option("--debug-invariants", help="check the manager every step (slow)")] = False,
    seed: Annotated[int | None, typer.Option(help="seed (of the embedded default workload)")] = None,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="run folder (default: runs/<name from workload and config>)")] = None,
    plots: Annotated[bool, typer.Option("--plots/--no-plots", help="write PNG plots")] = True,
) -> None:
    """Simulate WORKLOAD through the engine and write a run folder (tables, summary, plots)."""
    given = {
        "model": model, "gpu": gpu, "tensor_parallel": tp, "block_size": block_size,
        "num_gpu_blocks": num_gpu_blocks, "gpu_memory_utilization": gpu_memory_utilization,
        "num_cpu_blocks": num_cpu_blocks, "eviction": eviction, "watermark": watermark,
        "preemption": preemption, "scheduling": scheduling, "defrag_threshold": defrag_threshold,
        "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens, "load": load,
        "max_model_len": max_model_len, "long_prefill_token_threshold": long_prefill_token_threshold,
        "vllm_version": vllm_version, "step_time": step_time,
        "calibration": str(calibration) if calibration else None, "slo_ttft": slo_ttft,
        "slo_tpot": slo_tpot, "seed": seed,
    }  # fmt: skip
    changes: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
    if no_prefix_caching:
        changes["enable_prefix_caching"] = False
    if no_chunked_prefill:
        changes["enable_chunked_prefill"] = False
    if async_scheduling:
        changes["async_scheduling"] = True
    if record_ops:
        changes["record_ops"] = True
    if debug_invariants:
        changes["debug_invariants"] = True
    from sim.engine.config import ConfigError, SimConfig
    from sim.engine.cost_model import CostModel
    from sim.engine.run import simulate
    from sim.studies.run_folder import write_run
    from workloads.errors import WorkloadError

    try:
        cfg = SimConfig().replace(**changes).validate()
        cost = CostModel.from_config(cfg)
        blocks = cost.num_gpu_blocks(cfg)
        wl = open_workload(workload, format, skip_bad, cfg.seed)
        bar, progress = _progress_bar(wl)
    except (ConfigError, WorkloadError, ValueError) as e:
        raise fail(str(e)) from None
    name = str(workload) if workload is not None else "default"
    try:
        if bar is not None:
            with bar:
                result = simulate(wl, cfg, progress, cost_model=cost)
        else:
            result = simulate(wl, cfg, cost_model=cost)
    except (ConfigError, WorkloadError) as e:
        raise fail(str(e)) from None
    s = result.summary
    if s["requests"] and not s["finished"] and s["rejected"] + s["truncated"] == s["requests"]:
        raise fail(
            f"the KV cache ({blocks:,} blocks of {cfg.block_size} tokens) is too small for any "
            f"request of {name} (smallest dropped prompt: {_smallest_drop(result)} tokens)"
        )
    if s.get("skipped_lines"):
        typer.echo(f"skipped {s['skipped_lines']} bad lines (first: {wl.skipped_errors[0]})", err=True)
    out_dir = write_run(result, out if out is not None else RUNS_DIR / run_name(name, cfg), plots=plots)
    typer.echo(format_summary(result))
    typer.echo(f"wrote {out_dir}")


def register(app: typer.Typer) -> None:
    """Mount `run`, `report` and `compare` on the root `kvsim` app."""
    app.command("run")(run)
    app.command("report")(report)
    app.command("compare")(compare)
