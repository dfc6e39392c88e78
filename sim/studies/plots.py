"""PNG plots of a run: block usage and fragmentation, hit rate over time, latency CDFs.

Matplotlib's Agg backend only (no display); long runs are thinned to at most
MAX_POINTS per line, which changes nothing visible.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from kvsim.sim.engine.run import RunResult  # noqa: E402

MAX_POINTS = 4000
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


def plot_blocks(result: RunResult, path: Path) -> None:
    """Used / cached-free / free blocks, and id-space and internal fragmentation, over time."""
    st = result.step_columns("time", "used_blocks", "cached_blocks", "free_blocks", "id_fragmentation",
                             "internal_fragmentation", every=_every(result.num_steps))
    t = st["time"].to_numpy()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    top.plot(t, st["used_blocks"], label="used")
    top.plot(t, st["cached_blocks"], label="free, holding a cached prefix")
    top.plot(t, st["free_blocks"], label="free (all)")
    top.set_ylabel("blocks")
    top.legend(loc="upper right", fontsize="small")
    bottom.plot(t, st["id_fragmentation"], label="id-space (holes below max used id), blocks")
    bottom.plot(t, st["internal_fragmentation"] / result.config.block_size,
                label="internal (empty slots / block size), blocks")
    bottom.set_ylabel("fragmentation, blocks")
    bottom.set_xlabel("simulated time (s)")
    bottom.legend(loc="upper right", fontsize="small")
    fig.suptitle(title(result), fontsize="medium")
    _save(fig, path)


def plot_hit_rate(result: RunResult, path: Path) -> None:
    """Cumulative prefix-cache hit rate (token level) over time."""
    k = _every(result.num_steps)
    rate = hit_rate_over_time(result.step_columns("admitted_prompt_tokens", "admitted_hit_tokens"), k)
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot(result.step_columns("time", every=k)["time"].to_numpy(), 100 * rate)
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("cumulative hit rate (% of prompt tokens)")
    ax.set_ylim(0, 100)
    ax.set_title(title(result), fontsize="medium")
    _save(fig, path)


def _cdf(ax, values: pd.Series, label: str | None = None) -> None:
    v = np.sort(values.dropna().to_numpy())
    if len(v):
        ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=label)


def plot_latency(result: RunResult, path: Path) -> None:
    """CDFs of TTFT, TPOT and end-to-end latency (ms) over finished requests."""
    req = result.requests
    fin = req.loc[req["status"] == "finished", [col for col, _ in LATENCIES]]
    fig, axes = plt.subplots(1, 3, figsize=(12, 4))
    for ax, (col, name) in zip(axes, LATENCIES, strict=True):
        _cdf(ax, 1000 * fin[col])
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1)
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
        _cdf(axes[1, 0], 1000 * fin["ttft"], label)
        _cdf(axes[1, 1], 1000 * fin["e2e"], label)
    axes[0, 0].set(xlabel="simulated time (s)", ylabel="used blocks (% of cache)")
    axes[0, 1].set(xlabel="simulated time (s)", ylabel="cumulative hit rate (% of prompt tokens)")
    axes[1, 0].set(xlabel="TTFT (ms)", ylabel="fraction of requests", ylim=(0, 1))
    axes[1, 1].set(xlabel="end-to-end latency (ms)", ylabel="fraction of requests", ylim=(0, 1))
    for ax in axes.flat:
        ax.legend(fontsize="small")
    fig.suptitle("comparison: " + ", ".join(label for label, _ in runs), fontsize="medium")
    _save(fig, path)
