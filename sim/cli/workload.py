"""`kvsim workload ...`: generate synthetic workloads and describe any workload file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from kvsim.sim.cli.common import check_output, fail, progress_bar, staged_file
from kvsim.sim.cli.options import (
    DisableHybrid,
    Gpu,
    Model,
    RetentionInterval,
    Tp,
    hardware_changes,
    hybrid_changes,
    retention_changes,
)
from kvsim.workloads.names import ARRIVALS, FORMATS, KINDS

workload_app = typer.Typer(
    help="Generate workloads and print their statistics.", no_args_is_help=True, rich_markup_mode=None
)


@workload_app.command()
def generate(
    kind: Annotated[str, typer.Argument(help=f"one of: {', '.join(KINDS)}")],
    out: Annotated[Path, typer.Option("--out", "-o", help="kvsim JSONL file to write")],
    num_requests: Annotated[int | None, typer.Option("--num-requests", "-n", help="[default: 200]")] = None,
    rate: Annotated[
        float | None, typer.Option(help="arrivals per second (sessions/s for multi-turn, agent) [default: 1.0]")
    ] = None,
    arrival: Annotated[
        str | None, typer.Option(help=f"arrival process: {', '.join(ARRIVALS)} [default: poisson]")
    ] = None,
    cv: Annotated[
        float | None, typer.Option(help="gamma arrivals: coefficient of variation (burstiness) [default: 1.0]")
    ] = None,
    seed: Annotated[int, typer.Option()] = 0,
    prefix_len: Annotated[
        str | None, typer.Option(help="shared prefix length spec (system prompt, instruction)")
    ] = None,
    user_len: Annotated[
        str | None,
        typer.Option(help="per-request text length spec (message, query, tool result, prompt)"),
    ] = None,
    output_len: Annotated[str | None, typer.Option(help="output length spec")] = None,
    num_prefixes: Annotated[
        int | None, typer.Option(help="number of shared prompts (few-shot: tasks)")
    ] = None,
    zipf: Annotated[float | None, typer.Option(help="Zipf exponent of prompt popularity")] = None,
    turns: Annotated[
        str | None, typer.Option(help="turns (agent: steps) per session, length spec")
    ] = None,
    think_time: Annotated[
        float | None, typer.Option(help="mean pause between turns, seconds")
    ] = None,
    samples: Annotated[int | None, typer.Option(help="parallel: samples per request (n)")] = None,
    shots: Annotated[int | None, typer.Option(help="few-shot: most examples per prompt")] = None,
    example_len: Annotated[str | None, typer.Option(help="few-shot: example length spec")] = None,
) -> None:
    """Write a seeded synthetic workload as kvsim JSONL.

    Length specs: fixed:N, uniform:LO,HI, lognormal:MEAN,CV, empirical:FILE[:prompt|output].
    """
    if kind not in KINDS:
        raise fail(f"unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
    shape = {"--num-requests": num_requests, "--rate": rate, "--arrival": arrival, "--cv": cv}
    given = [name for name, v in shape.items() if v is not None]
    if kind == "default" and given:  # (its requests and arrivals are its own)
        raise fail(f"kind 'default' is the embedded workload (300 requests at their own times): it takes no "
                   f"{given[0]}")
    num_requests = 200 if num_requests is None else num_requests
    rate = 1.0 if rate is None else rate
    arrival = "poisson" if arrival is None else arrival
    cv = 1.0 if cv is None else cv
    if num_requests < 1:
        raise fail(f"--num-requests must be >= 1, got {num_requests}")
    from kvsim.workloads.build import build_workload
    from kvsim.workloads.errors import WorkloadError
    from kvsim.workloads.jsonl import write_jsonl

    options = {
        "prefix_len": prefix_len,
        "user_len": user_len,
        "output_len": output_len,
        "num_prefixes": num_prefixes,
        "zipf": zipf,
        "turns": turns,
        "think_time": think_time,
        "samples": samples,
        "shots": shots,
        "example_len": example_len,
    }
    check_output(out)
    try:
        wl = build_workload(kind, num_requests, rate, arrival, cv, seed, options)
        with staged_file(out) as tmp:  # a failed generation leaves no partial file
            count = write_jsonl(wl, tmp)
    except (WorkloadError, ValueError) as e:
        raise fail(str(e)) from None
    typer.echo(f"wrote {count} requests to {out}")


@workload_app.command()
def stats(
    file: Annotated[
        Path | None,
        typer.Argument(help="workload file or RAGPulse folder; default: the embedded workload"),
    ] = None,
    format: Annotated[str, typer.Option("--format", "-f", help="|".join(FORMATS))] = "auto",
    block_size: Annotated[int, typer.Option("--block-size", "-b")] = 16,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    skip_bad: Annotated[
        bool, typer.Option("--skip-bad", help="skip bad lines (and report how many)")
    ] = False,
    model: Model = None,
    gpu: Gpu = None,
    tp: Tp = None,
    disable_hybrid_kv_cache_manager: DisableHybrid = None,
    prefix_cache_retention_interval: RetentionInterval = None,
) -> None:
    """Requests, time span, rate, length percentiles and the ideal prefix-cache hit rate; with
    --model, also the ideal in the model's KV-cache layout (vLLM's hybrid groups: a replay through
    them with a pool nothing is evicted from), at its block size."""
    from kvsim.workloads.default import default_workload
    from kvsim.workloads.errors import WorkloadError
    from kvsim.workloads.stats import describe, format_stats
    from kvsim.workloads.traces import detect_format, load_workload

    if block_size < 1:
        raise fail(f"--block-size must be >= 1, got {block_size}")
    try:
        if file is None:
            wl, fmt = default_workload(), "default"
        else:
            fmt = detect_format(file) if format == "auto" else format
            wl = load_workload(file, fmt, skip_bad=skip_bad)
        layout, cfg = None, None
        if model is not None:
            from kvsim.sim.engine.config import ConfigError, SimConfig
            from kvsim.sim.engine.cost_model import CostModel

            try:
                cfg = SimConfig(block_size=block_size).replace(
                    **hardware_changes(model, gpu, tp), **hybrid_changes(disable_hybrid_kv_cache_manager, False),
                    **retention_changes(prefix_cache_retention_interval)).validate()
                block_size = CostModel.from_config(cfg).block_size  # (raised for Mamba state)
            except ConfigError as e:
                raise fail(str(e)) from None
        s = describe(wl, block_size)
        if cfg is not None:
            from contextlib import nullcontext

            from kvsim.sim.studies.layout_ideal import layout_ideal

            bar, progress = progress_bar(wl, f"replaying in {model}'s layout")  # (on a terminal only)
            try:
                with bar if bar is not None else nullcontext():
                    layout = layout_ideal(wl, cfg, s, progress)
            except ValueError as e:
                raise fail(str(e)) from None
    except WorkloadError as e:
        raise fail(str(e)) from None
    if s.skipped:
        typer.echo(f"skipped {s.skipped} bad lines (first: {wl.skipped_errors[0]})", err=True)
    if as_json:
        typer.echo(json.dumps({"format": fmt, **s.to_dict(), **({"layout_ideal": layout} if layout else {})}))
    else:
        typer.echo(f"format         {fmt}")
        typer.echo(format_stats(s))
        if layout is not None:
            where = (f"{model}'s {layout['groups']} KV-cache groups" if layout["groups"] > 1
                     else f"{model}'s one group")
            typer.echo(f"ideal in {where} (a sequential replay, nothing evicted, block size {layout['block_size']}):")
            typer.echo(f"  tokens       {layout['hit_rate']:.2%} ({layout['hit_tokens']:,} / {s.prompt_tokens:,} "
                       "prompt tokens)")
