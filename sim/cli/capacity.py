"""`kvsim capacity`: the highest rate a configuration serves within TTFT and TPOT targets.

It takes `kvsim run`'s knob options (the same names, defaults and checks: its parameters are
run's, read from `kvsim.sim.cli.run.run`), so policies, cache and offloading sizes can be compared
by the rate they sustain. With `--max-replicas N` it asks the cluster's question instead: the
fewest replicas behind each `--router` (several, comma-separated) that meet the targets at the
workload's rate. The searches are `kvsim.sim.studies.capacity`.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Annotated, Any

import typer

from kvsim.sim.cli.common import fail
from kvsim.sim.cli.run import run as _run_command

# run's options that capacity does not take: its own output, and the targets it asks for itself
ROUTERS = Annotated[str | None, typer.Option(help="the router (with --max-replicas: one or more, comma-separated, a search each) [default: round-robin]")]
NOT_KNOBS = {"out", "plots", "record_ops", "debug_invariants", "kv_events", "slo_ttft", "slo_tpot", "skip_bad",
             "workers"}  # (capacity has its own --workers: the searches it runs at once)


def _capacity(
    workload: Annotated[Path | None, typer.Argument(help="workload file; default: the embedded workload")] = None,
    slo_ttft: Annotated[float, typer.Option("--slo-ttft", help="time-to-first-token target, seconds")] = ...,
    slo_tpot: Annotated[float, typer.Option("--slo-tpot", help="time-per-output-token target, seconds")] = ...,
    attainment: Annotated[float, typer.Option(help="share of requests that must meet both targets")] = 0.9,
    gpu_hourly_cost: Annotated[float | None, typer.Option("--gpu-hourly-cost", help="dollars per GPU-hour: adds the cost per million output tokens")] = None,
    workers: Annotated[int, typer.Option("--workers", "-w", help="loads simulated at once, each round")] = 2,
    tolerance: Annotated[float, typer.Option(help="stop when the bracket is this narrow (relative)")] = 0.02,
    as_json: Annotated[bool, typer.Option("--json", help="print the answer as one JSON object")] = False,
    max_replicas: Annotated[int | None, typer.Option("--max-replicas", help="instead: the fewest replicas (1 to N, by bisection) behind each --router that meet the targets at the workload's rate (x --load)")] = None,
    **knobs: Any,
) -> None:
    """The highest arrival rate (the workload's arrivals rescaled) at which the configuration
    meets both targets for ATTAINMENT of the requests (DistServe's goodput), by bisection over
    simulated runs; per GPU, and with --gpu-hourly-cost what a million output tokens cost."""
    from kvsim.sim.api import default_cache, sweep_point
    from kvsim.sim.cli.run import check_fleet_options, knob_changes
    from kvsim.sim.engine.config import ConfigError, SimConfig
    from kvsim.sim.engine.cost_model import CostModel
    from kvsim.sim.studies.capacity import capacity
    from kvsim.sim.studies.sweep import WorkloadSpec
    from kvsim.workloads.errors import WorkloadError
    from kvsim.workloads.traces import load_workload

    routers = None
    if max_replicas is not None:
        if max_replicas < 1:
            raise fail(f"--max-replicas must be >= 1, got {max_replicas}")
        if knobs.get("replicas") is not None:
            raise fail("--max-replicas searches the replicas: give no --replicas")
        routers = (knobs.pop("router") or "round-robin").split(",")
    changes = knob_changes(knobs)
    try:
        # (a search for replicas checks the router's options against its first router, and each router's
        # config below against its own)
        cfg = SimConfig().replace(**changes, **({"router": routers[0]} if routers else {})).validate()
        derived = CostModel.from_config(cfg).num_gpu_blocks(cfg)
        cfg = default_cache(cfg, derived, workload is not None, changes)
        if workload is not None:
            load_workload(workload, knobs.get("format") or "auto")  # a bad path fails here, not in a worker
        spec = WorkloadSpec(path=str(workload), format=knobs.get("format") or "auto") if workload else WorkloadSpec()
    except (ConfigError, WorkloadError, ValueError) as e:
        raise fail(str(e)) from None
    check_fleet_options(changes, cfg, search=True, clusters=routers is not None)  # (`--max-replicas`: clusters)
    name = str(workload) if workload is not None else "the default workload"
    if routers is not None:
        return _replicas(spec, cfg, routers, name, slo_ttft=slo_ttft, slo_tpot=slo_tpot, attainment=attainment,
                         max_replicas=max_replicas, workers=workers, as_json=as_json)
    if not as_json:
        pools = " + ".join(f"{n} {pool} ({c.gpu} x{c.tensor_parallel}, {_blocks(c):,} blocks)" for n, pool, c in (
            (cfg.prefill_replicas, "prefill", cfg.pool_config("prefill")),
            (cfg.decode_replicas, "decode", cfg.pool_config("decode")))) if cfg.prefill_replicas else ""
        fleet = (f"{pools} replicas (decider {cfg.pd_decider}) of "
                 if cfg.prefill_replicas else f"{cfg.replicas} replicas behind {cfg.router} of " if cfg.replicas > 1 else "")
        # (a P/D cluster's pools give their own; replicas that differ, the base's)
        hardware = "" if cfg.prefill_replicas else \
            f" on {cfg.gpu} x{cfg.tensor_parallel}, {_cache_words(cfg, each=cfg.replicas > 1)}"
        typer.echo(f"capacity of {name}: {fleet}{cfg.model}{hardware}, eviction {cfg.eviction}; targets TTFT <= "
                   f"{slo_ttft:g} s and TPOT <= {slo_tpot:g} s for {attainment:.0%} of requests")

    def shown(p: Any, lo: float | None, hi: float | None) -> None:
        bracket = f"[{'?' if lo is None else f'{lo:.4g}'}, {'?' if hi is None else f'{hi:.4g}'}]"
        typer.echo(f"  load x{p.load:<8.4g} {p.rate_rps:9.3f} req/s  {p.attainment:7.2%} met  "
                   f"{'meets' if p.meets else 'misses'}   bracket {bracket}", err=as_json)

    try:
        c = capacity(spec, cfg, slo_ttft=slo_ttft, slo_tpot=slo_tpot, attainment=attainment, workers=workers,
                     tolerance=tolerance, gpu_hourly_cost=gpu_hourly_cost, on_probe=shown, point=sweep_point)
    except (ConfigError, WorkloadError) as e:
        raise fail(str(e)) from None
    out = c.as_dict()
    if as_json:
        typer.echo(json.dumps(out))
        return
    if c.best is None:
        typer.echo(f"no rate tried meets the targets: even x{c.probes[-1].load:.4g} of the workload's rate "
                   f"({c.probes[-1].rate_rps:.4g} req/s) gives {c.probes[-1].attainment:.1%}")
        raise typer.Exit(1)
    lines = [f"sustains {c.rate_rps:.3f} req/s ({c.rate_per_gpu:.3f} per GPU, {c.gpus} GPU"
             f"{'s' if c.gpus > 1 else ''}) with {c.best.attainment:.1%} of requests within both targets"]
    if c.above is not None:
        lines.append(f"  at {c.above.rate_rps:.3f} req/s only {c.above.attainment:.1%} do")
    else:
        lines.append(f"  (the highest rate tried: the search stopped at x{c.best.load:.4g} of the workload's rate)")
    if c.cost_per_million_output_tokens is not None:
        lines.append(f"cost ${c.cost_per_million_output_tokens:.3f} per million output tokens at "
                     f"${gpu_hourly_cost:g} per GPU-hour ({out['output_tokens_per_s']:,.0f} output tokens/s)")
    typer.echo("\n".join(lines))


def _blocks(cfg: Any) -> int:
    """A replica's KV blocks: given, or as its GPU's memory holds them."""
    from kvsim.sim.engine.cost_model import CostModel

    return cfg.num_gpu_blocks or CostModel.from_config(cfg).num_gpu_blocks(cfg)


def _cache_words(cfg: Any, each: bool = False) -> str:
    """A replica's cache in the header: its blocks (`each`: of several replicas), and whence, when the
    GPU's memory sized it."""
    whence = "" if cfg.num_gpu_blocks else " (from the GPU's memory)"
    return f"{_blocks(cfg):,} blocks{' each' if each else ''}{whence}"


def _replicas(spec: Any, cfg: Any, routers: list[str], name: str, *, slo_ttft: float, slo_tpot: float,
              attainment: float, max_replicas: int, workers: int, as_json: bool) -> None:
    """`kvsim capacity --max-replicas N`: the fewest replicas a router needs at the workload's
    rate, a search per router, each probe shown as it lands; exit 1 if a router needs more than N."""
    from kvsim.sim.cluster.run import cluster_point
    from kvsim.sim.engine.config import ConfigError
    from kvsim.sim.studies.capacity import replicas_for_rate
    from kvsim.workloads.errors import WorkloadError
    from kvsim.workloads.stats import describe

    try:
        configs = [cfg.replace(router=r).validate() for r in routers]
        stats = describe(spec.open(), cfg.block_size)
    except (ConfigError, WorkloadError, ValueError) as e:
        raise fail(str(e)) from None
    rate = stats.mean_rate * cfg.load
    if not as_json:
        typer.echo(f"replicas for {name} at {rate:.3f} req/s: {cfg.model} on {cfg.gpu} x{cfg.tensor_parallel}, "
                   f"{_cache_words(cfg, each=True)}, eviction {cfg.eviction}; targets TTFT <= "
                   f"{slo_ttft:g} s and TPOT <= {slo_tpot:g} s for {attainment:.0%} of requests")
    answers = []
    for c in configs:
        def shown(p: Any, router: str = c.router) -> None:
            typer.echo(f"  {router:<20} {p.replicas:>4} replica{'s' if p.replicas > 1 else ' '}  "
                       f"{p.attainment:7.2%} met  {'meets' if p.meets else 'misses'}", err=as_json)

        try:
            answers.append(replicas_for_rate(spec, c, cluster_point, slo_ttft=slo_ttft, slo_tpot=slo_tpot,
                                             max_replicas=max_replicas, attainment=attainment, workers=workers,
                                             on_probe=shown))
        except (ConfigError, WorkloadError) as e:
            raise fail(str(e)) from None
    if as_json:
        typer.echo(json.dumps({"rate_rps": rate, "target_attainment": attainment, "slo_ttft": slo_ttft,
                               "slo_tpot": slo_tpot, "gpus_per_replica": cfg.tensor_parallel,
                               "routers": {a.router: a.as_dict() for a in answers}}))
        return
    for a in answers:
        if a.best is None:
            typer.echo(f"{a.router}: more than {max_replicas} replicas; {max_replicas} meet the targets for only "
                       f"{a.below.attainment:.1%} of requests")
            continue
        n, gpus = a.best.replicas, a.best.replicas * cfg.tensor_parallel
        below = "" if a.below is None else (f"; {a.below.replicas} give{'s' if a.below.replicas == 1 else ''} "
                                              f"{a.below.attainment:.1%}")
        typer.echo(f"{a.router}: {n} replica{'s' if n > 1 else ''} ({gpus} GPU{'s' if gpus > 1 else ''}), "
                   f"{a.best.attainment:.1%} of requests within both targets{below}")
    if any(a.best is None for a in answers):
        raise typer.Exit(1)


def _knob_parameters() -> list[inspect.Parameter]:
    """`kvsim run`'s options, as capacity's keyword-only parameters (annotations resolved); --router
    takes several names with --max-replicas."""
    params = inspect.signature(_run_command, eval_str=True).parameters
    out = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for name, p in params.items()
           if name not in NOT_KNOBS and name != "workload"]
    return [p.replace(annotation=ROUTERS) if p.name == "router" else p for p in out]


def command() -> Any:
    """The `capacity` command: `_capacity` with run's knob options added to its signature."""
    own = [p for p in inspect.signature(_capacity, eval_str=True).parameters.values()
           if p.kind is not inspect.Parameter.VAR_KEYWORD]
    sig = inspect.Signature([*own, *_knob_parameters()])

    def capacity(**options: Any) -> None:
        own_names = {p.name for p in own}
        _capacity(**{k: v for k, v in options.items() if k in own_names},
                  **{k: v for k, v in options.items() if k not in own_names})

    capacity.__doc__ = _capacity.__doc__
    capacity.__signature__ = sig  # type: ignore[attr-defined]
    capacity.__annotations__ = {p.name: p.annotation for p in sig.parameters.values()}
    return capacity


def register(app: typer.Typer) -> None:
    """Mount `capacity` on the root `kvsim` app."""
    app.command("capacity")(command())
