"""PNG plots of a run: block usage and fragmentation, hit rate over time, latency CDFs.

Matplotlib's Agg backend only (no display); long runs are thinned to at most
MAX_POINTS per line, which changes nothing visible.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from kvsim.sim.engine.run import RunResult  # noqa: E402
from kvsim.sim.studies.units import seconds  # noqa: E402

MAX_POINTS = 4000
BINS = 800  # time slices the per-step series are averaged into (about one a pixel)
PLOTS = ("blocks.png", "hit_rate.png", "latency.png")
LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2e", "end-to-end latency"))


def title(result: RunResult) -> str:
    """'<workload>: <model> on <gpu> xTP, block size, policy, blocks' for every figure."""
    c, s = result.config, result.summary
    return (
        f"{result.workload}: {c.model} on {c.gpu} x{c.tensor_parallel}, block {c.block_size}, "
        f"{c.eviction}, {s.get('num_gpu_blocks', '?')} blocks"
    )


def _save(fig: plt.Figure, path: str | Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _every(num_steps: int) -> int:
    return max(1, num_steps // MAX_POINTS)


def _thin(steps: pd.DataFrame) -> pd.DataFrame:
    return steps.iloc[:: _every(len(steps))]


def hit_rate_over_time(steps: pd.DataFrame, every: int = 1) -> np.ndarray:
    """Cumulative token-level hit rate after each step (first admissions only); with `every`,
    after every `every`-th step only."""
    prompt = np.cumsum(steps["admitted_prompt_tokens"].to_numpy())[::every]
    hit = np.cumsum(steps["admitted_hit_tokens"].to_numpy())[::every]
    return np.divide(hit, prompt, out=np.zeros(len(hit)), where=prompt > 0)


def resample(t: np.ndarray, weight: np.ndarray, columns: dict[str, np.ndarray], bins: int = BINS,
             how: str = "mean") -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Per-step series on `bins` equal slices of simulated time: each slice holds the mean of its
    steps weighted by `weight` (their durations: a time average), or with how="sum" their sum;
    a slice with no step (the engine idle) keeps the value before it (a sum: 0). Returns the
    slices' start times and the series. Steps far outnumber pixels on real traces (9k to 368k)."""
    if len(t) == 0:
        return t, {k: v[:0] for k, v in columns.items()}
    lo, hi = float(t[0]), float(t[-1])
    edges = np.linspace(lo, hi if hi > lo else lo + 1.0, bins + 1)
    which = np.clip(np.searchsorted(edges, t, side="right") - 1, 0, bins - 1)
    out = {}
    wsum = np.bincount(which, weights=weight, minlength=bins)
    for name, v in columns.items():
        if how == "sum":
            out[name] = np.bincount(which, weights=v.astype(float), minlength=bins)
            continue
        mean = np.bincount(which, weights=v * weight, minlength=bins) / np.where(wsum > 0, wsum, 1)
        filled = pd.Series(np.where(wsum > 0, mean, np.nan)).ffill().bfill().to_numpy()
        out[name] = filled
    return edges[:-1], out


def plot_blocks(result: RunResult, path: Path) -> None:
    """Where the cache's blocks are over time, as a stacked area (used / free but holding a cached
    prefix / free and empty), and id-space and internal fragmentation; time-averaged slices. A run
    in vLLM's hybrid KV-cache groups adds the blocks each group holds (`summary.json`'s
    `kv_cache_groups` names them)."""
    st = result.step_columns("time", "duration", "used_blocks", "cached_blocks", "free_blocks",
                             "id_fragmentation", "internal_fragmentation")
    used, cached, free = (st[c].to_numpy().astype(float) for c in ("used_blocks", "cached_blocks", "free_blocks"))
    t, r = resample(st["time"].to_numpy(), st["duration"].to_numpy(), {
        "used": used, "cached": cached, "empty": free - cached,
        "id": st["id_fragmentation"].to_numpy().astype(float),
        "internal": st["internal_fragmentation"].to_numpy() / result.config.block_size})
    usage = result.group_usage
    groups = result.summary.get("kv_cache_groups") or []
    if usage is not None and len(usage) == len(st) and len(groups) == usage.shape[1]:
        fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(10, 8.8), sharex=True, height_ratios=(3, 2.4, 2))
        _groups_panel(middle, st, usage, groups)
    else:
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6.4), sharex=True, height_ratios=(3, 2))
    top.stackplot(t, r["used"], r["cached"], r["empty"], step="post", linewidth=0,
                  labels=("used by running requests", "free, holding a cached prefix (evictable)", "free and empty"),
                  colors=("tab:blue", "tab:orange", "0.85"))
    top.set_ylabel("blocks")
    top.set_ylim(0, max(float((r["used"] + r["cached"] + r["empty"]).max()), 1.0))
    top.legend(loc="lower right", fontsize="small", framealpha=0.9)
    top.set_title("KV cache blocks (time-averaged)", fontsize="medium")
    bottom.plot(t, r["id"], drawstyle="steps-post", label="id-space (holes below the highest used id)")
    bottom.plot(t, r["internal"], drawstyle="steps-post", label="internal (empty slots / block size)")
    bottom.set_ylabel("fragmentation, blocks")
    bottom.set_xlabel("simulated time (s)")
    bottom.legend(loc="best", fontsize="small")
    fig.suptitle(title(result), fontsize="medium")
    _save(fig, path)


def _groups_panel(ax: Any, st: pd.DataFrame, usage: pd.DataFrame, groups: list[dict]) -> None:
    """The blocks each KV-cache group holds over time, stacked (time-averaged slices)."""
    names = [f"{g['group']}: {g['kind'].replace('_', ' ')}" + (f" {g['window']:,}" if g.get("window") else "")
             for g in groups]
    t, r = resample(st["time"].to_numpy(), st["duration"].to_numpy(),
                    {name: usage[c].to_numpy().astype(float) for name, c in zip(names, usage.columns, strict=True)})
    ax.stackplot(t, *(r[n] for n in names), step="post", linewidth=0, labels=names)
    ax.set_ylabel("blocks in use")
    ax.set_title("blocks in use by each KV-cache group (one pool; a shared block counts once)", fontsize="medium")
    ax.legend(loc="upper right", fontsize="x-small", ncol=2 if len(names) > 4 else 1, framealpha=0.9)


def plot_hit_rate(result: RunResult, path: Path) -> None:
    """Token-level prefix hit rate over time: cumulative, and per slice of time (what happens
    after warm-up), against the workload's ideal (an infinite cache) when the summary has it."""
    st = result.step_columns("time", "admitted_prompt_tokens", "admitted_hit_tokens")
    t = st["time"].to_numpy()
    prompt, hit = st["admitted_prompt_tokens"].to_numpy(), st["admitted_hit_tokens"].to_numpy()
    k = _every(len(t))
    cum = hit_rate_over_time(st, k)
    slices = int(np.clip(np.count_nonzero(prompt) // 10, 10, 200))  # about 10 admissions a slice, or more
    ts, r = resample(t, np.ones(len(t)), {"prompt": prompt, "hit": hit}, bins=slices, how="sum")
    window = np.divide(r["hit"], r["prompt"], out=np.full(len(ts), np.nan), where=r["prompt"] > 0)
    fig, ax = plt.subplots(figsize=(10, 4.2))
    ax.plot(ts, 100 * window, drawstyle="steps-post", color="tab:blue", alpha=0.45, lw=0.9,
            label=f"per {(t[-1] - t[0]) / max(len(ts), 1):.3g} s slice" if len(t) else "per slice")
    ax.plot(t[::k], 100 * cum, color="tab:blue", lw=2, label="cumulative")
    ideal = result.summary.get("ideal_hit_rate")
    if ideal is not None:
        ax.axhline(100 * ideal, color="0.3", ls="--", lw=1.2, label=f"ideal, an infinite cache ({ideal:.1%})")
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("hit rate (% of prompt tokens)")
    ax.set_ylim(0, 100)
    ax.legend(loc="lower right", fontsize="small")
    ax.set_title(title(result), fontsize="medium")
    _save(fig, path)


def _cdf(ax, values: pd.Series, label: str | None = None):
    v = np.sort(values.dropna().to_numpy())
    if len(v):
        return ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=label)[0]
    return None


def plot_latency(result: RunResult, path: Path) -> None:
    """CDFs of TTFT, TPOT and end-to-end latency over finished requests on log axes, with their
    p50 and p99 marked and the SLOs drawn; an overloaded run adds its waiting queue over time."""
    req = result.requests
    fin = req.loc[req["status"] == "finished", [col for col, _ in LATENCIES]]
    s, cfg = result.summary, result.config
    slo = {"ttft": cfg.slo_ttft, "tpot": cfg.slo_tpot}
    overloaded = bool(s.get("overloaded"))
    fig, axes = plt.subplots(1, 4 if overloaded else 3, figsize=(16 if overloaded else 13, 4.2))
    for ax, (col, name) in zip(axes, LATENCIES, strict=False):
        v = fin[col].dropna()
        v = v[v > 0]
        _cdf(ax, v)
        for q, style in ((50, ":"), (99, "--")):
            if len(v):
                x = float(np.percentile(v, q))
                ax.axvline(x, color="0.35", ls=style, lw=1, label=f"p{q} {seconds(x)}")
        if slo.get(col) is not None:
            ax.axvline(slo[col], color="tab:red", lw=1.5, label=f"SLO {seconds(slo[col])}")
        if len(v):
            ax.set_xscale("log")
        ax.set_xlabel(f"{name} (s, log)")
        ax.set_ylabel("fraction of finished requests")
        ax.set_ylim(0, 1)
        ax.legend(loc="upper left", fontsize="small")
    if overloaded:
        ax = axes[3]
        st = result.step_columns("time", "duration", "waiting", "running")
        t, r = resample(st["time"].to_numpy(), st["duration"].to_numpy(),
                        {"waiting": st["waiting"].to_numpy().astype(float), "running": st["running"].to_numpy().astype(float)})
        ax.plot(t, r["waiting"], drawstyle="steps-post", label="waiting")
        ax.plot(t, r["running"], drawstyle="steps-post", label="running")
        since = s.get("overloaded_since_s")
        if since is not None:
            ax.axvline(float(st["time"].iloc[0]) + since, color="tab:red", lw=1, label="overloaded from here")
        ax.set(xlabel="simulated time (s)", ylabel="requests",
               title=f"OVERLOADED: served {s['served_rps']:.3g} of {s['offered_rps']:.3g} offered req/s")
        ax.title.set_fontsize("small")
        ax.legend(loc="upper left", fontsize="small")
    fig.suptitle(title(result), fontsize="medium")
    _save(fig, path)


def warm_up() -> None:
    """Draw and drop a small figure, so the first real one does not pay for loading fonts."""
    fig, ax = plt.subplots(figsize=(2, 2))
    ax.plot([0, 1], [0, 1], label="x")
    ax.legend()
    ax.set_title("x")
    fig.tight_layout()
    fig.canvas.draw()
    plt.close(fig)


def write_plots(result: RunResult, out_dir: str | Path, names: tuple[str, ...] = PLOTS) -> list[Path]:
    """A run's plots into `out_dir`: all of them, or those `names` (of PLOTS) only."""
    draw = {"blocks.png": plot_blocks, "hit_rate.png": plot_hit_rate, "latency.png": plot_latency}
    paths = [Path(out_dir) / name for name in names]
    for name, path in zip(names, paths, strict=True):
        draw[name](result, path)
    return paths


def plot_overlay(runs: list[tuple[str, RunResult]], path: str | Path) -> None:
    """Several runs on shared axes: block usage and hit rate over time, TTFT and e2e CDFs."""
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for label, r in runs:
        st = _thin(r.steps)
        usable = max(int(r.summary.get("num_gpu_blocks", 2)) - 1, 1)
        axes[0, 0].plot(st["time"], 100 * st["used_blocks"] / usable, label=label)
        rate = hit_rate_over_time(r.steps)
        k = max(1, len(rate) // MAX_POINTS)
        axes[0, 1].plot(r.steps["time"].to_numpy()[::k], 100 * rate[::k], label=label)
        fin = r.requests[r.requests["status"] == "finished"]
        _cdf(axes[1, 0], fin["ttft"][fin["ttft"] > 0], label)
        _cdf(axes[1, 1], fin["e2e"][fin["e2e"] > 0], label)
    axes[0, 0].set(xlabel="simulated time (s)", ylabel="used blocks (% of cache)")
    axes[0, 1].set(xlabel="simulated time (s)", ylabel="cumulative hit rate (% of prompt tokens)")
    axes[1, 0].set(xlabel="TTFT (s, log)", ylabel="fraction of finished requests", ylim=(0, 1), xscale="log")
    axes[1, 1].set(xlabel="end-to-end latency (s, log)", ylabel="fraction of finished requests", ylim=(0, 1),
                   xscale="log")
    for ax in axes.flat:
        ax.legend(fontsize="small")
    fig.suptitle("comparison: " + ", ".join(label for label, _ in runs), fontsize="medium")
    _save(fig, path)
