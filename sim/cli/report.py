"""Summary tables for one run or several side by side: `kvsim report` and `kvsim compare`."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvsim.sim.cli.common import check_output, fail
from kvsim.sim.studies.units import seconds

if TYPE_CHECKING:
    from kvsim.sim.engine.run import RunResult


def _num(fmt: str) -> Callable[[Any], str]:
    return lambda v: "-" if v is None else fmt.format(v)


def _pct(v: Any) -> str:
    return "-" if v is None else f"{100 * v:.2f}%"


def _p3(key: str) -> Callable[[dict], str]:
    """p50 / p90 / p99 of a latency, each in its own unit."""
    def cell(s: dict) -> str:
        return " / ".join(seconds(s.get(f"{key}_p{p}")) for p in (50, 90, 99))
    return cell


def _goodput(s: dict) -> str:
    v = s.get("goodput_rps")
    return "n/a (no SLO)" if v is None else f"{v:,.3f} ({_pct(s.get('slo_attainment'))} met)"


def _offered(s: dict) -> str:
    offered, served = s.get("offered_rps"), s.get("served_rps", s.get("throughput_rps"))
    text = f"{'-' if offered is None else f'{offered:,.3f}'} / {'-' if served is None else f'{served:,.3f}'}"
    return text + ("  OVERLOADED" if s.get("overloaded") else "")


# (label, key or function of the summary, formatter)
ROWS: list[tuple[str, str | Callable[[dict], str], Callable[[Any], str] | None]] = [
    ("requests", "requests", _num("{:,}")),
    ("finished", "finished", _num("{:,}")),
    ("rejected / truncated", lambda s: f"{s.get('rejected', 0):,} / {s.get('truncated', 0):,}", None),
    ("simulated time (s)", "duration_s", _num("{:,.1f}")),
    ("engine steps", "steps", _num("{:,}")),
    ("hit rate, tokens", "hit_rate", _pct),
    ("hit rate, blocks", "block_hit_rate", _pct),
    ("offered / served (req/s)", _offered, None),
    ("output tokens/s", "output_tokens_per_s", _num("{:,.1f}")),
    ("goodput (req/s)", _goodput, None),
    ("TTFT p50/p90/p99", _p3("ttft"), None),
    ("TPOT p50/p90/p99", _p3("tpot"), None),
    ("e2e p50/p90/p99", _p3("e2e"), None),
    ("queueing p50/p90/p99", _p3("queueing"), None),
    ("GPU blocks", "num_gpu_blocks", _num("{:,}")),
    ("peak / mean block usage", lambda s: f"{_pct(s.get('peak_block_usage'))} / {_pct(s.get('mean_block_usage'))}", None),
    ("evictions", "evictions", _num("{:,}")),
    ("preemptions (recompute / swap)",
     lambda s: f"{s.get('preemptions_recompute', 0):,} / {s.get('preemptions_swap', 0):,}", None),
    ("swapped blocks (out / in)",
     lambda s: f"{s.get('swapped_out_blocks', 0):,} / {s.get('swapped_in_blocks', 0):,}", None),
    ("CoW copies", "cow_copies", _num("{:,}")),
    ("defrag moves", "defrag_moves", _num("{:,}")),
    ("mean id-space fragmentation (blocks)", "mean_id_fragmentation", _num("{:,.1f}")),
    ("mean internal fragmentation (slots)", "mean_internal_fragmentation", _num("{:,.1f}")),
]


# KV offloading's rows, shown when a run had a host tier (sim.engine.offload)
OFFLOAD_ROWS: list[tuple[str, str | Callable[[dict], str], Callable[[Any], str] | None]] = [
    ("host tier chunks", "host_chunks", _num("{:,}")),
    ("host tier hit tokens", "offload_hit_tokens", _num("{:,}")),
    ("hit rate, GPU + host tier", "total_hit_rate", _pct),
    ("blocks stored / loaded", lambda s: f"{s.get('stored_blocks', 0):,} / {s.get('loaded_blocks', 0):,}", None),
    ("host evictions / failed stores",
     lambda s: f"{s.get('offload_evictions', 0):,} / {s.get('offload_store_failures', 0):,}", None),
]
FS_ROWS: list[tuple[str, str | Callable[[dict], str], Callable[[Any], str] | None]] = [
    ("file tier hit tokens", "fs_hit_tokens", _num("{:,}")),
    ("file tier files / chunks read", lambda s: f"{s.get('fs_files', 0):,} / {s.get('fs_chunks_read', 0):,}", None),
    ("file tier failed jobs", "fs_failed_jobs", _num("{:,}")),
]


def cells(summary: dict[str, Any], rows=ROWS) -> list[str]:
    """One formatted value per row of `rows`; a value the summary lacks is "-"."""
    out = []
    for _, key, fmt in rows:
        out.append(key(summary) if callable(key) else fmt(summary.get(key)))
    return out


def format_table(summaries: list[dict[str, Any]], headers: list[str] | None = None) -> str:
    """Rows of ROWS (and OFFLOAD_ROWS if a run had a host tier), one column per summary (right-aligned),
    with optional column headers."""
    rows = ROWS + (OFFLOAD_ROWS if any("host_chunks" in s for s in summaries) else []) \
        + (FS_ROWS if any("fs_files" in s for s in summaries) else [])
    cols = [cells(s, rows) for s in summaries]
    label_w = max(len(label) for label, _, _ in rows)
    widths = [max(len(c) for c in col) for col in cols]
    lines = []
    if headers:
        widths = [max(w, len(h)) for w, h in zip(widths, headers, strict=True)]
        lines.append(" " * label_w + "".join(f"  {h:>{w}}" for h, w in zip(headers, widths, strict=True)))
    for i, (label, _, _) in enumerate(rows):
        lines.append(f"{label:<{label_w}}" + "".join(f"  {col[i]:>{w}}" for col, w in zip(cols, widths, strict=True)))
    return "\n".join(lines)


def header(result: RunResult) -> str:
    """What was simulated: workload, model, GPU, cache size (blocks and tokens), eviction policy, scheduler mode."""
    c, s = result.config, result.summary
    blocks = int(s.get("num_gpu_blocks") or 0)
    return (
        f"{result.workload} ({s.get('requests', 0):,} requests): {c.model} on {c.gpu} x{c.tensor_parallel}, "
        f"KV cache {blocks:,} blocks x {c.block_size} tokens = {blocks * c.block_size:,} tokens, "
        f"eviction {c.eviction}, {scheduling(c)}"
    )


def scheduling(c: Any) -> str:
    """The scheduler's mode as a header names it: 'async scheduling' (`vllm serve` 0.33's default) or 'sync'."""
    return mode_words(c.runs_async)


def mode_words(runs_async: bool) -> str:
    """'async scheduling' or 'sync scheduling' (a config's `runs_async`, or a P/D summary's flag)."""
    return "async scheduling" if runs_async else "sync scheduling"


FIGURES = ("requests", "hit rate", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "goodput")


def figure_cells(f: dict[str, Any]) -> list[str]:
    """A run's or a replica's figures (`sim.cluster.run.REPLICA_FIGURES`, as a lone run's summary
    has them too), formatted for the columns `FIGURES`."""
    return [f"{f['requests']:,}", _pct(f["hit_rate"])] + [
        "-" if f.get(k) is None else seconds(f[k]) for k in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99")
    ] + ["-" if f.get("goodput_rps") is None else f"{f['goodput_rps']:.2f}/s"]


def aligned(rows: list[list[str]]) -> list[str]:
    """Rows of cells as lines: the first column left-aligned, the others right-aligned."""
    widths = [max(len(r[j]) for r in rows) for j in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths, strict=True)))
            .rstrip() for r in rows]


def _imbalance(section: dict[str, Any]) -> str:
    imb, peak = section["imbalance_mean"], section["imbalance_peak"]
    return "-" if imb is None else f"{imb:.2f} / {peak:.2f}"


def cluster_table(section: dict[str, Any]) -> str:
    """A cluster's summary (`sim.cluster.run.cluster_summary`): a row a replica and one for all of
    them together (requests, hit rate, TTFT and TPOT p50/p99, goodput), then the load imbalance and a
    prefix-aware router's prediction against the hits."""
    rows = [["replica", *FIGURES]] + [[_replica_label(i, f), *figure_cells(f)] for i, f in enumerate(section["per_replica"])]
    lines = aligned(rows + [["all", *figure_cells(section["overall"])]])
    lines.append(f"router {section['router']} over {section['replicas']} replicas; load imbalance (most in-flight "
                 f"requests on one replica over the mean, time-averaged / peak): {_imbalance(section)}")
    p = section.get("prediction")
    if p:  # a prefix-aware router: what it expected each replica to hit, against the hits
        lines.append(f"its prefix prediction: {p['expected_tokens']:,} prompt tokens expected to hit, "
                     f"{p['hit_tokens']:,} hit; more expected than hit on {p['over']:,} of {p['requests']:,} "
                     f"requests ({p['over_tokens']:,} tokens), fewer on {p['under']:,} ({p['under_tokens']:,})")
    return "\n".join(lines)


def cluster_head(result: Any, block_size: int) -> str:
    """What a cluster run simulated (`result`: a `ClusterResult`, or one read back from its folder):
    workload, replicas and what they run on (each group where they differ), blocks of `block_size`
    tokens, eviction policy, scheduler mode."""
    cfg, section = result.config, result.summary["cluster"]
    requests = f"{result.workload} ({section['overall']['requests']:,} requests)"
    if cfg.replica_pools:  # replicas that differ: each group's GPU, TP and blocks
        groups: dict[tuple, int] = {}
        for r in result.replicas:
            key = (r.config.gpu, r.config.tensor_parallel, int(r.summary["num_gpu_blocks"]))
            groups[key] = groups.get(key, 0) + 1
        fleet = ", ".join(f"{n} on {g} x{tp} ({b:,} blocks)" for (g, tp, b), n in groups.items())
        return (f"{requests}: {cfg.replicas} replicas of {cfg.model}: {fleet}; blocks of {block_size} tokens, "
                f"eviction {cfg.eviction}, {scheduling(cfg)}")
    blocks = int(result.replicas[0].summary["num_gpu_blocks"])
    return (f"{requests}: {cfg.replicas} replicas of {cfg.model} on {cfg.gpu} x{cfg.tensor_parallel}, KV cache "
            f"{blocks:,} blocks x {block_size} tokens each, eviction {cfg.eviction}, {scheduling(cfg)}")


def _replica_label(i: int, figures: dict[str, Any]) -> str:
    """Replica i, with what it runs on where a cluster's replicas differ (`replica_pools`)."""
    return f"{i} ({figures['pool']})" if "pool" in figures else str(i)


def runs_table(runs: list[tuple[str, dict[str, Any]]]) -> str:
    """Runs side by side, a row each, lone runs and clusters alike (`kvsim compare` given a cluster
    run folder): `runs` pairs a label with a lone run's summary or a cluster's section; a cluster's
    row holds its figures over all replicas, with a row for each replica under it."""
    rows = [["run", "replicas", *FIGURES, "imbalance"]]
    for label, s in runs:
        if "per_replica" not in s:
            rows.append([label, "1", *figure_cells(s), "-"])
            continue
        rows.append([label, f"{s['replicas']} x {s['router']}", *figure_cells(s["overall"]), _imbalance(s)])
        rows += [[f"  replica {_replica_label(i, f)}", "", *figure_cells(f), ""] for i, f in enumerate(s["per_replica"])]
    return "\n".join(aligned(rows))


def pd_lines(summary: dict[str, Any]) -> list[str]:
    """A P/D run's figures in words, as `kvsim run` prints them and `kvsim report` again (its summary,
    with the `pd` section)."""
    s = summary["pd"]
    link = f", link {s['link_gbps']:g} GB/s a rank" if "link_gbps" in s else ""
    lines = [f"{summary['workload']} ({s['requests']:,} requests) on {summary['model']}: "
             + " + ".join(f"{s[name + '_replicas']} {name} ({p['gpu']} x{p['tensor_parallel']}, {p['num_gpu_blocks']:,} "
                          "blocks)" for name, p in s["pools"].items())
             + f" replicas, router {s['router']}, decider {s['decider']}{link}, "
             + mode_words(s.get("async_scheduling", False)),  # (absent: a run from before P/D ran async)
             f"  finished {s['finished']:,}, disaggregated {s['remote']:,}; read {s['read_bytes'] / 1e9:,.2f} GB a rank",
             f"  TTFT p50 {seconds(s['ttft_p50'])}, p99 {seconds(s['ttft_p99'])}; TPOT p50 {seconds(s['tpot_p50'])}, "
             f"p99 {seconds(s['tpot_p99'])}",
             "  mean TTFT parts (disaggregated): " + ", ".join(
                 f"{k.replace('_', ' ')} {seconds(s[k + '_mean'])}" for k in
                 ("prefill_queue", "prefill", "decode_queue", "transfer", "promotion")),
             f"  prefill side: blocks held {s['held_block_seconds']:,.1f} block-seconds, hold mean {seconds(s['hold_mean'])}"]
    if s["goodput_rps"] is not None:
        lines.append(f"  goodput {s['goodput_rps']:.3f} req/s ({s['goodput_rps_per_gpu']:.3f} per GPU), "
                     f"SLO attainment {s['slo_attainment']:.1%}")
    return lines


PD_COLUMNS = ("run", "prefill", "decode", "router", "decider", "requests", "remote", "TTFT p50", "TTFT p99",
              "TPOT p50", "TPOT p99", "transfer", "read", "goodput/GPU")


def pd_table(runs: list[tuple[str, dict[str, Any]]]) -> str:
    """P/D runs side by side (`kvsim compare` given P/D run folders): a row a run, `runs` pairing a
    label with its `pd` section."""
    rows = [list(PD_COLUMNS)]
    for label, s in runs:
        pools = s["pools"]
        rows.append([label, *(f"{s[n + '_replicas']} x {pools[n]['gpu']} TP{pools[n]['tensor_parallel']}"
                              for n in ("prefill", "decode")), s["router"], s["decider"], f"{s['requests']:,}",
                     f"{s['remote']:,}", *("-" if s.get(k) is None else seconds(s[k]) for k in
                                          ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "transfer_mean")),
                     f"{s['read_bytes'] / 1e9:,.2f} GB",
                     "-" if s.get("goodput_rps_per_gpu") is None else f"{s['goodput_rps_per_gpu']:.3f}/s"])
    return "\n".join(aligned(rows))


def reading(s: dict[str, Any], caching: bool = True) -> str:
    """The table in plain words: how much hit, whether the cache filled and evicted, preemptions."""
    if s.get("peak_block_usage") is None:
        return ""
    peak, blocks, ev = s["peak_block_usage"], int(s.get("num_gpu_blocks", 0)), s.get("evictions", 0)
    lines = _load_words(s) + [f"{_pct(s.get('hit_rate'))} of prompt tokens were prefix-cache hits."]
    if not caching:
        lines = _load_words(s) + [f"Prefix caching is off; block usage peaked at {_pct(peak)} of {blocks:,} blocks."]
    elif not s.get("hit_tokens"):
        lines.append(f"No prompt found a cached prefix (no two share one), so no eviction policy can raise "
                     f"the hit rate on this workload; block usage peaked at {_pct(peak)} of {blocks:,} blocks.")
    elif ev:
        usage = "The cache filled" if peak >= 0.9 else "Block usage peaked"
        lines.append(f"{usage} ({_pct(peak)} of {blocks:,} blocks at peak) and {ev:,} cached blocks "
                     "were evicted to make room, so the eviction policy matters.")
    else:
        lines.append(f"Block usage peaked at {_pct(peak)} of {blocks:,} blocks and nothing was evicted, "
                     "so every eviction policy gives this result (a smaller --num-gpu-blocks makes them differ).")
    if "host_chunks" in s:
        lines.append(f"The host tier ({s['host_chunks']:,} chunks) served {s.get('offload_hit_tokens', 0):,} more "
                     f"prompt tokens: {_pct(s.get('total_hit_rate'))} were hits in all.")
    dropped = [f"{n:,} {'was' if n == 1 else 'were'} {what}"
               for n, what in ((s.get("rejected", 0), "rejected"), (s.get("truncated", 0), "truncated")) if n]
    if dropped:
        why = ", ".join(f"{k[len('dropped_'):].replace('_', ' ')}: {v:,}" for k, v in s.items()
                        if k.startswith("dropped_") and v)
        lines.append(f"Of {s.get('requests', 0):,} requests, {' and '.join(dropped)} ({why}); they count "
                     "in no latency.")
    pre = s.get("preemptions_recompute", 0) + s.get("preemptions_swap", 0)
    lines.append(f"{pre:,} running requests were preempted to free blocks." if pre
                 else "No request was preempted.")
    return " ".join(lines)


def _load_words(s: dict[str, Any]) -> list[str]:
    """Overload, said first: the served against the offered rate, and since when."""
    if not s.get("overloaded"):
        return []
    since = s.get("overloaded_since_s")
    when = f" after the first {seconds(since)}" if since else ""
    return [f"OVERLOADED: the engine served {s['served_rps']:,.3f} of {s['offered_rps']:,.3f} offered requests/s; "
            f"its waiting queue never emptied{when}, so the latencies grow with the trace's length "
            "and measure the backlog, not the configuration (`kvsim capacity` finds the rate it sustains)."]


def group_table(s: dict[str, Any]) -> str:
    """vLLM's hybrid KV-cache groups, a line each: kind and window, layers, blocks in use at most,
    blocks a window (or Mamba state) let go of, the hit tokens the group alone offered, and its
    cached blocks evicted ("" with one group; a run folder written before evictions were counted
    by group shows "-")."""
    groups = s.get("kv_cache_groups")
    if not groups:
        return ""
    lines = ["", "KV-cache group            layers  peak blocks  freed behind window  own hit tokens    evicted"]
    for g in groups:
        kind = g["kind"].replace("_", " ") + (f" {g['window']:,}" if g["window"] else "")
        evicted = g.get("evicted_blocks")
        lines.append(f"{g['group']:>2} {kind:<22} {len(g['layers']):>6}  {g['peak_blocks']:>11,}  "
                     f"{g['blocks_freed_behind_window']:>19,}  {g['own_hit_tokens']:>14,}  "
                     f"{'-' if evicted is None else f'{evicted:,}':>9}")
    return "\n".join(lines)


def format_summary(result: RunResult, notes: list[str] | None = None) -> str:
    """A run's header line (with `notes` under it, indented), its summary table and the
    table's reading in plain words."""
    lines = [header(result)]
    lines += [textwrap.fill(n, 100, initial_indent="  ", subsequent_indent="    ",
                           break_on_hyphens=False) for n in notes or []]
    text = "\n".join(lines) + "\n" + format_table([result.summary]) + group_table(result.summary)
    line = reading(result.summary, result.config.enable_prefix_caching)
    return text + ("\n\n" + textwrap.fill(line, 100) if line else "")


def _open(run_dir: Path) -> RunResult:
    from kvsim.sim.studies.run_folder import load_run

    try:
        return load_run(run_dir)
    except (OSError, ValueError) as e:
        raise fail(str(e)) from None


def report(
    run_dir: Annotated[Path, typer.Argument(help="a run folder written by `kvsim run`")],
    plots: Annotated[bool, typer.Option("--plots/--no-plots", help="regenerate the PNG plots")] = True,
) -> None:
    """Print a run's summary table and regenerate its plots (a cluster's table and cluster.png, a
    P/D run's figures and pd.png)."""
    from kvsim.sim.studies import cluster_folder
    from kvsim.sim.studies.pd_folder import PLOT, is_pd_folder, load_pd, plot_pd

    if cluster_folder.is_cluster_folder(run_dir):
        try:
            run = cluster_folder.load_cluster(run_dir)
        except (OSError, ValueError) as e:
            raise fail(str(e)) from None
        typer.echo(cluster_head(run, run.replicas[0].config.block_size) + "\n" + cluster_table(run.summary["cluster"]))
        if plots:
            cluster_folder.plot_cluster(run, run_dir / cluster_folder.PLOT)
            typer.echo(f"wrote {run_dir / cluster_folder.PLOT}")
        return
    if is_pd_folder(run_dir):
        try:
            pd_run = load_pd(run_dir)
        except (OSError, ValueError) as e:
            raise fail(str(e)) from None
        typer.echo("\n".join(pd_lines(pd_run.summary)))
        if plots:
            plot_pd(pd_run, run_dir / PLOT)
            typer.echo(f"wrote {run_dir / PLOT}")
        return
    result = _open(run_dir)
    typer.echo(format_summary(result))
    if plots:
        from kvsim.sim.studies.plots import write_plots

        for p in write_plots(result, run_dir):
            typer.echo(f"wrote {p}")


def compare(
    run_dirs: Annotated[list[Path], typer.Argument(help="run folders to set side by side (a cluster's too: `kvsim run --replicas N`; P/D runs with P/D runs)")],
    plot: Annotated[Path | None, typer.Option("--plot", help="write an overlay plot (PNG) here (lone runs only)")] = None,
) -> None:
    """Side-by-side summary of several runs, and optionally an overlay plot. Given a cluster run
    folder, a row a run: each cluster's figures over all its replicas, and each replica's under it."""
    from kvsim.sim.studies.cluster_folder import cluster_section, is_cluster_folder
    from kvsim.sim.studies.pd_folder import is_pd_folder, load_pd

    labels = [d.name or str(d) for d in run_dirs]
    try:
        clusters = [d for d in run_dirs if is_cluster_folder(d)]
        pds = [d for d in run_dirs if is_pd_folder(d)]
    except (OSError, ValueError) as e:
        raise fail(str(e)) from None
    if pds:
        if len(pds) < len(run_dirs):
            other = next(d for d in run_dirs if d not in pds)
            raise fail(f"{other}: not a P/D run folder; compare P/D runs with P/D runs ({pds[0]} is one)")
        if plot is not None:
            raise fail(f"--plot overlays lone runs; {pds[0]} is a P/D run (its folder has pd.png)")
        try:
            typer.echo(pd_table([(label, load_pd(d).summary["pd"]) for label, d in zip(labels, run_dirs, strict=True)]))
        except (OSError, ValueError) as e:
            raise fail(str(e)) from None
        return
    if clusters:
        if plot is not None:
            raise fail(f"--plot overlays lone runs; {clusters[0]} is a cluster run (its folder has cluster.png)")
        try:
            runs = [(label, cluster_section(d) if d in clusters else _open(d).summary)
                    for label, d in zip(labels, run_dirs, strict=True)]
        except (OSError, ValueError) as e:
            raise fail(str(e)) from None
        typer.echo(runs_table(runs))
        return
    if plot is not None:
        check_output(plot)
    results = [_open(d) for d in run_dirs]
    typer.echo(format_table([r.summary for r in results], labels))
    if plot is not None:
        from kvsim.sim.studies.plots import plot_overlay

        plot_overlay(list(zip(setting_labels(results, labels), results, strict=True)), plot)
        typer.echo(f"wrote {plot}")


def setting_labels(results: list[RunResult], names: list[str]) -> list[str]:
    """Each run named by the settings in which the runs differ (`eviction=s3fifo, block_size=32`),
    and by its workload when those differ; the folder name where nothing differs."""
    configs = [r.config.to_dict() for r in results]
    keys = [k for k in configs[0] if len({repr(c.get(k)) for c in configs}) > 1]
    if len({r.workload for r in results}) > 1:
        keys = ["workload", *keys]
    if not keys:
        return names
    return [", ".join(f"{k}={r.workload if k == 'workload' else c.get(k)}" for k in keys)
            for r, c in zip(results, configs, strict=True)]
