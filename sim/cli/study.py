"""`kvsim sweep`, `kvsim curve`, `kvsim regress`: studies made of many runs."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated

import typer

from kvsim.sim.cli.common import cannot_write, check_output, fail
from kvsim.sim.cli.options import (
    AsyncScheduling,
    Gpu,
    KvOffloadingSize,
    Model,
    OffloadAll,
    OffloadBlocksPerChunk,
    OffloadEvictionPolicy,
    OffloadStoreThreshold,
    Tp,
    hardware_changes,
    offload_changes,
)

_CPUS = os.cpu_count() or 1


def sweep(
    config: Annotated[Path, typer.Argument(help="sweep file (TOML with [base] and [grid] tables)")],
    workers: Annotated[int, typer.Option("--workers", "-w", help="local processes")] = _CPUS,
    ray: Annotated[
        bool, typer.Option("--ray", help="run the points on Ray (pip install 'kvsim[ray]')")
    ] = False,
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="output folder [default: sweeps/<config name>]"),
    ] = None,
    vllm_version: Annotated[
        str | None,
        typer.Option("--vllm-version", help="vLLM release for every point (overrides [base]), 0.23-0.33"),
    ] = None,
) -> None:
    """Run every point of a parameter grid; finished points are kept, so a rerun resumes."""
    from kvsim.sim.api import sweep_point
    from kvsim.sim.engine.config import ConfigError, SimConfig
    from kvsim.sim.studies.sweep import check_params, load_sweep, run_sweep
    from kvsim.workloads.errors import WorkloadError

    check_workers(workers)
    try:
        sw = load_sweep(config)
        if vllm_version is not None:
            SimConfig(vllm_version=vllm_version).validate()
            sw.base["vllm_version"] = vllm_version
            check_params(sw.base, f"--vllm-version {vllm_version}")
        out_dir = out or Path("sweeps") / config.stem
        check_output(out_dir, folder=True)
        total = len(sw.points())
        done = [0]

        def report(pt, rec, skipped: bool) -> None:
            done[0] += 1
            s = rec["summary"]
            note = "already done" if skipped else (
                f"hit rate {s.get('hit_rate', 0):.2%}, {s.get('throughput_rps', 0):.2f} req/s")
            if not skipped and "imbalance_mean" in s:  # a cluster's point
                imb = s["imbalance_mean"]
                note += f", imbalance {imb:.2f}" if imb is not None else ""
            typer.echo(f"[{done[0]}/{total}] {pt.id}: {note}")

        t0 = time.perf_counter()
        table = run_sweep(sw, out_dir, workers, ray, report, point_fn=sweep_point)
    except (ConfigError, WorkloadError) as e:
        raise fail(str(e)) from None
    typer.echo(
        f"wrote {out_dir / 'sweep.parquet'} ({len(table)} points, {time.perf_counter() - t0:.1f} s)"
    )


def check_workers(workers: int) -> None:
    """--workers must be at least 1 (one line, like every other bad value)."""
    if workers < 1:
        raise fail(f"--workers must be >= 1, got {workers}")


def _int_list(text: str, what: str) -> list[int]:
    try:
        return [int(x.replace("_", "")) for x in text.split(",") if x.strip()]
    except ValueError:
        from kvsim.sim.engine.config import ConfigError

        raise ConfigError(f"{what} must be comma-separated integers, got {text!r}") from None


def curve(
    workload: Annotated[Path, typer.Argument(help="workload file (any `kvsim workload` format)")],
    capacities: Annotated[
        str,
        typer.Option("--capacities", "-c", help="cache sizes in GPU blocks, e.g. 1000,2000,4000"),
    ],
    policies: Annotated[
        str, typer.Option("--policies", "-p", help="eviction policies, comma-separated")
    ] = "lru",
    block_size: Annotated[int, typer.Option("--block-size", "-b", help="tokens per block")] = 16,
    mode: Annotated[
        str, typer.Option("--mode", "-m", help="replay (cache only, fast) | sim (full simulator)")
    ] = "replay",
    workers: Annotated[int, typer.Option("--workers", "-w", help="local processes")] = _CPUS,
    format: Annotated[
        str, typer.Option("--format", "-f", help="workload format (auto by default)")
    ] = "auto",
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="output folder [default: curves/<workload name>]"),
    ] = None,
    vllm_version: Annotated[
        str, typer.Option("--vllm-version", help="vLLM release whose rules to follow, 0.23-0.33")
    ] = "0.33",
    model: Model = None,
    gpu: Gpu = None,
    tp: Tp = None,
    kv_offloading_size: KvOffloadingSize = None,
    offload_eviction_policy: OffloadEvictionPolicy = None,
    offload_store_threshold: OffloadStoreThreshold = None,
    offload_blocks_per_chunk: OffloadBlocksPerChunk = None,
    offload_all: OffloadAll = False,
    async_scheduling: AsyncScheduling = None,
) -> None:
    """Prefix hit rate and fragmentation against cache capacity, one line per eviction policy
    (with --kv-offloading-size, over a host tier too: its hits and the total hit rate; the
    scheduler's mode, in sim mode, as `kvsim run` takes it)."""
    from kvsim.sim.engine.config import ConfigError, SimConfig
    from kvsim.sim.engine.cost_model import CostModel
    from kvsim.sim.studies.curves import capacity_curve, check_points, format_table, write_curve
    from kvsim.sim.studies.sweep import WorkloadSpec
    from kvsim.workloads.errors import WorkloadError

    check_workers(workers)
    try:
        caps = _int_list(capacities, "--capacities")
        pols = [p.strip() for p in policies.split(",") if p.strip()]
        check_points(caps, pols, block_size, mode)
        changes = {**hardware_changes(model, gpu, tp), **offload_changes(
            kv_offloading_size, offload_eviction_policy, offload_store_threshold, offload_blocks_per_chunk,
            offload_all)}
        if async_scheduling is not None:
            if mode != "sim":
                raise ConfigError(f"--{'' if async_scheduling else 'no-'}async-scheduling needs --mode sim "
                                  f"(mode {mode} replays the cache alone, with no scheduler)")
            changes["async_scheduling"] = async_scheduling
        base = SimConfig(vllm_version=vllm_version, block_size=block_size).replace(**changes).validate()
        if changes:  # an unknown model, or one that TP does not split, fails here
            CostModel.from_config(base)
        spec = WorkloadSpec(str(workload), format)
        spec.open()  # fail early on a missing file or an unknown format
        out_dir = out or Path("curves") / workload.stem
        check_output(out_dir, folder=True)
        t0 = time.perf_counter()
        total, seen = len(set(caps)) * len(pols), []

        def progress(row: dict) -> None:  # on stderr, as each point finishes (largest capacities first)
            seen.append(row)
            typer.echo(f"  point {len(seen)}/{total}: {row['policy']} at {row['capacity']:,} blocks, hit rate "
                       f"{row['hit_rate']:.2%} ({time.perf_counter() - t0:.1f} s)", err=True)

        df = capacity_curve(spec, caps, pols, block_size, mode, workers, base if changes else None,
                            on_point=progress, vllm_version=vllm_version)
        wall = time.perf_counter() - t0
        from kvsim.workloads.stats import describe

        ideal = describe(spec.open(), block_size).ideal_token_hit_rate  # the curves' ceiling
        write_curve(df, out_dir, workload.name, block_size, mode, ideal)
    except (ConfigError, WorkloadError) as e:
        raise fail(str(e)) from None
    except OSError as e:
        raise cannot_write(out_dir, e) from None
    typer.echo(f"{workload.name}: block size {block_size}, mode {mode}, {len(df)} points")
    typer.echo("\nprefix hit rate (% of prompt tokens)")
    typer.echo(format_table(df))
    if "total_hit_rate" in df:
        typer.echo(f"\nGPU + host tier hit rate (% of prompt tokens; {kv_offloading_size:g} GiB host tier)")
        typer.echo(format_table(df, "total_hit_rate"))
    typer.echo("\nmean id-space fragmentation (blocks)")
    typer.echo(format_table(df, "mean_id_fragmentation", percent=False))
    typer.echo(f"\nwrote {out_dir / 'curve.parquet'} and {out_dir / 'curve.png'} ({wall:.1f} s)")


def regress(
    baseline_dir: Annotated[Path, typer.Argument(help="a baseline folder, or a folder of them")],
    update: Annotated[
        bool, typer.Option("--update", help="rewrite expected.json from this run")
    ] = False,
    workers: Annotated[int, typer.Option("--workers", "-w", help="local processes")] = 1,
) -> None:
    """Recompute golden curves and fail (exit 1) when a point moves beyond its tolerance."""
    from kvsim.sim.engine.config import ConfigError
    from kvsim.sim.studies import regress as rg
    from kvsim.workloads.errors import WorkloadError

    check_workers(workers)
    failed = 0
    try:
        for folder in rg.baseline_folders(baseline_dir):
            b = rg.load_baseline(folder)
            expected = None if update else rg.load_expected(b)
            t0 = time.perf_counter()
            got = rg.compute(b, workers)
            wall = time.perf_counter() - t0
            if update:
                rg.write_expected(b, got)
                n = sum(len(v) for v in got.values())
                typer.echo(f"updated {b.expected_path} ({n} values, {wall:.1f} s)")
                continue
            cmp = rg.compare(b, expected, got)
            bad = cmp.failures
            if bad:
                failed += 1
                typer.echo(f"FAIL {folder}: {len(bad)} of {len(cmp.rows)} values beyond tolerance")
                typer.echo(rg.format_diff(bad))
            else:
                typer.echo(f"ok   {folder}: {len(cmp.rows)} values within tolerance ({wall:.1f} s)")
    except (ConfigError, WorkloadError) as e:
        raise fail(str(e)) from None
    if failed:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Mount the study commands on the root `kvsim` app."""
    app.command("sweep")(sweep)
    app.command("curve")(curve)
    app.command("regress")(regress)
