"""`kvsim conform`: run a workload through kvsim and through the installed vLLM, diff per request."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer

from kvsim.sim.cli.common import fail, open_workload
from kvsim.sim.cli.options import (
    AsyncScheduling,
    DisableHybrid,
    HybridChunkedLocal,
    KvLeaseDuration,
    KvOffloadingSize,
    KvTransferGbps,
    KvTransferLatency,
    KvTransferRole,
    LongPrefillAdaptive,
    MaxNumActiveSeqs,
    MaxNumScheduledTokens,
    Model,
    NoReserveFullIsl,
    OffloadAll,
    OffloadBlocksPerChunk,
    OffloadEvictionPolicy,
    OffloadStoreThreshold,
    PrefillScheduleInterval,
    RetentionInterval,
    Tp,
    admission_changes,
    hardware_changes,
    hybrid_changes,
    offload_changes,
    retention_changes,
    transfer_changes,
)


def conform(
    workload: Annotated[Path | None, typer.Argument(help="workload file (any `kvsim workload` format); default: the embedded workload")] = None,
    mode: Annotated[str, typer.Option("--mode", "-m", help="manager | scheduler | both | events (the KV-event streams, step by step: step grid, prefix caching, n = 1)")] = "both",
    format: Annotated[str, typer.Option("--format", "-f", help="workload format (auto by default)")] = "auto",
    block_size: Annotated[int, typer.Option(help="tokens per KV block")] = 16,
    num_gpu_blocks: Annotated[int, typer.Option(help="KV blocks, block 0 (the null block) included")] = 2000,
    max_running: Annotated[int, typer.Option("--max-running", "-k", help="manager mode: 1 sequential, K > 1 concurrent")] = 1,
    max_num_seqs: Annotated[int | None, typer.Option(help="most sequences per step (default: vLLM's for the GPU)")] = None,
    max_num_batched_tokens: Annotated[int | None, typer.Option(help="token budget per step (default: vLLM's for the GPU)")] = None,
    long_prefill_token_threshold: Annotated[int, typer.Option(help="most prefill tokens of one request per step (0: no cap)")] = 0,
    long_prefill_token_threshold_adaptive: LongPrefillAdaptive = False,
    max_num_active_seqs: MaxNumActiveSeqs = None,
    no_scheduler_reserve_full_isl: NoReserveFullIsl = False,
    prefill_schedule_interval: PrefillScheduleInterval = None,
    max_num_scheduled_tokens: MaxNumScheduledTokens = None,
    watermark: Annotated[float, typer.Option(help="fraction of blocks kept free at admission")] = 0.0,
    no_prefix_caching: Annotated[bool, typer.Option("--no-prefix-caching", help="disable prefix caching")] = False,
    no_chunked_prefill: Annotated[bool, typer.Option("--no-chunked-prefill", help="a prompt must fit one step")] = False,
    scheduling: Annotated[str, typer.Option(help="fcfs | priority")] = "fcfs",
    model: Model = None,
    tp: Tp = None,
    sliding_window: Annotated[int | None, typer.Option(help="attention window in tokens (vLLM's SlidingWindowSpec; default: the model's)")] = None,
    disable_hybrid_kv_cache_manager: DisableHybrid = None,
    hybrid_chunked_local: HybridChunkedLocal = False,
    prefix_cache_retention_interval: RetentionInterval = None,
    max_model_len: Annotated[int | None, typer.Option(help="scheduler mode: tokens per sequence; longer answers stop there (default: no limit)")] = None,
    gpu: Annotated[str, typer.Option(help="GPU name (picks vLLM's default batch limits)")] = "h100-sxm",
    step_time: Annotated[float | None, typer.Option("--step-time", help="scheduler mode: seconds per step on a fixed grid, sessions open loop (default: each step as long as the cost model says for its batch, closed-loop sessions, as `kvsim run`)")] = None,
    async_scheduling: AsyncScheduling = None,
    vllm_version: Annotated[str | None, typer.Option("--vllm-version", help="kvsim's rules (default: the installed vLLM's release)")] = None,
    kv_offloading_size: KvOffloadingSize = None,
    offload_eviction_policy: OffloadEvictionPolicy = None,
    offload_store_threshold: OffloadStoreThreshold = None,
    offload_blocks_per_chunk: OffloadBlocksPerChunk = None,
    offload_all: OffloadAll = False,
    kv_transfer_role: KvTransferRole = None,
    kv_transfer_gbps: KvTransferGbps = None,
    kv_transfer_latency: KvTransferLatency = None,
    kv_lease_duration: KvLeaseDuration = None,
    random_seeds: Annotated[str | None, typer.Option("--random", help="START:STOP: instead, one random workload and configuration a seed (sim.conform.random_cases)")] = None,
    only_hybrid: Annotated[bool, typer.Option("--only-hybrid", help="with --random: only the seeds whose case is a model in vLLM's hybrid KV-cache groups")] = False,
    pd: Annotated[bool, typer.Option("--pd", help="with --random: every case stands alone as one side of P/D disaggregation (the seed's case less the knobs the NIXL connector does not take)")] = False,
    cluster_run: Annotated[Path | None, typer.Option("--cluster-run", help="instead, one replica of this cluster run folder (`kvsim run --replicas N`): the requests it received, at the times they reached it, under the run's config; WORKLOAD is the one the run was made with")] = None,
    replica: Annotated[int | None, typer.Option("--replica", help="with --cluster-run: which replica (0 to N-1)")] = None,
) -> None:
    """Diff kvsim against the installed vLLM request by request; exit 1 on any difference."""
    from kvsim.sim.conform import vllm_setup
    from kvsim.sim.conform.check import MANAGER_NO_OFFLOADING, MANAGER_NO_SAMPLES, MODES
    from kvsim.sim.conform.check import conform as run_conform
    from kvsim.sim.engine.config import ConfigError, SimConfig
    from kvsim.workloads.errors import WorkloadError

    if mode not in MODES:
        raise fail(f"--mode must be one of {', '.join(MODES)}, got {mode!r}")
    # an option of one mode given to the other alone would change nothing, silently
    if mode not in ("manager", "both") and max_running != 1:
        raise fail(f"--max-running is the manager mode's (K sequences at once), and --mode {mode} runs no manager "
                   "mode: give --mode manager or both, or leave it out")
    scheduler_only = [name for name, v in (("--step-time", step_time), ("--max-model-len", max_model_len)) if v is not None]
    if mode == "manager" and scheduler_only:
        raise fail(f"{scheduler_only[0]} is the scheduler mode's, and --mode manager runs the block manager alone: "
                   "give --mode scheduler or both, or leave it out")
    seeds = None if random_seeds is None else _seeds(random_seeds)
    if seeds is None and (pd or only_hybrid):
        hint = " (one side of P/D for a workload: --kv-transfer-role)" if pd else ""
        raise fail(f"--{'pd' if pd else 'only-hybrid'} picks among --random's cases: give --random START:STOP{hint}")
    if seeds is not None and workload is not None:
        raise fail("--random makes its own workloads: give no workload file")
    if seeds is not None and cluster_run is None:
        given = _knobs_given(locals())
        if given:
            raise fail(f"--random makes its own configurations: give no --{given[0].replace('_', '-')}")
    if (cluster_run is None) != (replica is None):
        raise fail("--cluster-run FOLDER and --replica I go together: one replica of a cluster run")
    if cluster_run is not None:
        given = _knobs_given(locals())
        if given:
            raise fail(f"--cluster-run takes the run's config from its folder: give no --{given[0].replace('_', '-')}")
        if seeds is not None:
            raise fail("--cluster-run and --random are two different cases: give one")
    missing = vllm_setup.vllm_available()
    if missing:
        raise fail(missing)
    installed = vllm_setup.vllm_version()
    if seeds is not None:
        _random(seeds, mode, only_hybrid, pd)
        return
    try:
        from kvsim.kvcache.profiles import profile

        theirs = profile(installed).version
        if vllm_version is not None and profile(vllm_version).version != theirs:
            raise fail(f"--vllm-version {vllm_version} but vLLM {installed} is installed: compare like with like")
        if cluster_run is not None:
            requests, cfg, name = _replica_case(cluster_run, replica, workload, format)
            if profile(cfg.vllm_version).version != theirs:
                raise fail(f"{cluster_run} ran kvsim's rules for vLLM {cfg.vllm_version} but vLLM {installed} "
                           "is installed: compare like with like")
        else:
            offload = offload_changes(kv_offloading_size, offload_eviction_policy, offload_store_threshold,
                                      offload_blocks_per_chunk, offload_all)
            admission = admission_changes(max_num_active_seqs, long_prefill_token_threshold_adaptive,
                                          no_scheduler_reserve_full_isl, prefill_schedule_interval,
                                          max_num_scheduled_tokens)
            cfg = SimConfig(
                gpu=gpu, block_size=block_size, num_gpu_blocks=num_gpu_blocks, max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens, long_prefill_token_threshold=long_prefill_token_threshold,
                watermark=watermark, enable_prefix_caching=not no_prefix_caching, sliding_window=sliding_window,
                max_model_len=max_model_len,
                enable_chunked_prefill=not no_chunked_prefill, scheduling=scheduling, step_time=step_time,
                closed_loop_sessions=step_time is None, vllm_version=theirs, async_scheduling=async_scheduling, **offload,
                **admission, **retention_changes(prefix_cache_retention_interval),
                **transfer_changes(kv_transfer_role, kv_transfer_gbps, kv_transfer_latency, kv_lease_duration),
                **hardware_changes(model, None, tp), **hybrid_changes(disable_hybrid_kv_cache_manager, hybrid_chunked_local),
            ).validate()
            requests = list(open_workload(workload, format, False, cfg.seed))
            name = "the default workload" if workload is None else str(workload)
        if mode == "events":  # (refused before the header, not after it)
            from kvsim.sim.conform.check import check_events_case

            check_events_case(cfg, requests)
        tokens, seqs = cfg.batch_limits()
        from kvsim.sim.engine.cost_model import CostModel

        cost = CostModel.from_config(cfg)
        layout = cost.layout
        raised = f" (raised from {cfg.block_size} for Mamba state)" if cost.block_size != cfg.block_size else ""
        typer.echo(f"kvsim vs vLLM {installed} on {name}: {len(requests):,} requests, {cfg.model}, block size "
                   f"{cost.block_size}{raised}, {cfg.num_gpu_blocks:,} blocks, budget {tokens:,} tokens / {seqs:,} seqs, "
                   + ("the cost model's clock" if cfg.step_time is None else f"a {cfg.step_time:g} s step grid")
                   + (", async scheduling" if cfg.runs_async else ", sync scheduling")
                   + (f", a {cfg.sliding_window}-token sliding window" if cfg.sliding_window is not None else "")
                   + (f", vLLM's hybrid KV-cache groups: {layout.describe()}" if layout is not None else "")
                   + (f", {cfg.kv_offloading_size:g} GiB KV offloading" if cfg.kv_offloading_size is not None else "")
                   + (f", P/D {cfg.kv_transfer_role} side (vLLM's NixlConnector, reads at {cfg.kv_transfer_gbps:g} GB/s)"
                      if cfg.kv_transfer_role is not None else ""))
        if cfg.kv_transfer_role is not None and mode == "both":
            typer.echo("manager   skipped: the manager mode has no scheduler and no KV connector")
        elif cfg.kv_offloading_size is not None and mode == "both":
            typer.echo(f"manager   skipped: {MANAGER_NO_OFFLOADING.split(';')[0]}")
        elif any(r.n > 1 for r in requests) and mode == "both":
            typer.echo(f"manager   skipped: {MANAGER_NO_SAMPLES.split(';')[0]}")
        started = time.perf_counter()

        def starting(which: str) -> None:  # on stderr: where a long comparison is
            typer.echo(f"  {which} mode: running kvsim, then vLLM ({time.perf_counter() - started:.1f} s so far)",
                       err=True)

        diffs = run_conform(requests, cfg, mode, max_running, lambda d: typer.echo(d.format()), starting)
    except (ConfigError, WorkloadError, ValueError, FileNotFoundError) as e:
        raise fail(str(e)) from None
    if not all(d.ok for d in diffs):
        raise typer.Exit(1)
    typer.echo("identical")


CLUSTER_RUN_OWN = ("workload", "mode", "format", "max_running", "random_seeds", "only_hybrid", "pd", "cluster_run",
                   "replica")


def _knobs_given(values: dict) -> list[str]:
    """The configuration options given away from their defaults (a cluster run's folder sets them)."""
    import inspect

    params = inspect.signature(conform).parameters
    return [n for n, p in params.items() if n not in CLUSTER_RUN_OWN and values[n] != p.default]


def _replica_case(folder: Path, replica: int, workload: Path | None, format: str) -> tuple[list, Any, str]:
    """One replica of a cluster run folder: the requests it received (from WORKLOAD, or the embedded
    workload under the run's seed), the config it replays under alone, and its name for the header."""
    from kvsim.sim.studies.cluster_folder import load_received, replica_config

    cfg = replica_config(folder, replica).validate()
    received = load_received(folder, replica, open_workload(workload, format, False, cfg.seed))
    return list(received), cfg, f"replica {replica} of {folder} ({received.name})"


def _seeds(text: str) -> range:
    """'START:STOP' (or 'N' for 0:N) as a range of seeds."""
    try:
        lo, hi = text.split(":") if ":" in text else ("0", text)
        seeds = range(int(lo), int(hi))
    except ValueError:
        raise fail(f"--random takes START:STOP (two integers), got {text!r}") from None
    if not seeds:
        raise fail(f"--random {text}: no seeds in that range")
    return seeds


def _random(seeds: range, mode: str, only_hybrid: bool = False, pd: bool = False) -> None:
    """Conform one random case a seed, a line each; the seeds that differ or fail, and how to rerun
    one. Only kvsim's refusal of a case (its ConfigError, raised outside vLLM and the vLLM drivers
    `sim.conform.vllm_*`) is a skip; any other error fails its seed, in vLLM (or a driver) or in kvsim.
    `only_hybrid`: the seeds whose case is not a model in hybrid groups are passed over, uncounted;
    `pd`: each seed's P/D case (`random_case(seed, pd=True)`)."""
    from kvsim.sim.conform.check import conform as run_conform
    from kvsim.sim.conform.random_cases import HYBRID_MODELS, random_case
    from kvsim.sim.engine.config import ConfigError

    def in_vllm(e: BaseException) -> bool:
        """Whether a frame `e` passed through is vLLM's or a vLLM driver's (by module name)."""
        tb = e.__traceback__
        while tb is not None:
            name = tb.tb_frame.f_globals.get("__name__", "")
            if name == "vllm" or name.startswith(("vllm.", "kvsim.sim.conform.vllm_")):
                return True
            tb = tb.tb_next
        return False

    differ, failed, skipped, passed_over = [], [], 0, 0
    for seed in seeds:
        case = None
        try:
            case = random_case(seed, pd=pd)
            if only_hybrid and case.cfg.model not in HYBRID_MODELS:
                passed_over += 1
                continue
            diffs = run_conform(case.requests, case.cfg, mode, case.max_running)
        except Exception as e:  # every error is reported, one line a seed
            vllm = in_vllm(e)
            if isinstance(e, ConfigError) and not vllm:  # kvsim refuses the case before vLLM runs it
                typer.echo(f"seed {seed}: skipped ({e})")
                skipped += 1
                continue
            head = case.describe() if case is not None else f"seed {seed}"
            typer.echo(f"{head}: failed in {'vLLM' if vllm else 'kvsim'}: {type(e).__name__}: {' '.join(str(e).split())}")
            failed.append(seed)
            continue
        bad = [d.format() for d in diffs if not d.ok]
        typer.echo(f"{case.describe()}: " + ("; ".join(bad) if bad else "identical"))
        if bad:
            differ.append(seed)
    typer.echo(f"{len(seeds) - passed_over} cases, {len(differ)} differ" + (f", {len(failed)} failed" if failed else "")
               + (f", {skipped} skipped" if skipped else "")
               + (f" ({passed_over} seeds without hybrid groups passed over)" if passed_over else ""))
    for seed in sorted(differ + failed):
        typer.echo(f"  rerun: kvsim conform --random {seed}:{seed + 1} --mode {mode}" + (" --only-hybrid" if only_hybrid else "")
                   + (" --pd" if pd else ""))
    if differ or failed:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("conform")(conform)
