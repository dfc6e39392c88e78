"""Hit rate and fragmentation against cache capacity, one curve per eviction policy.

A point is (policy, capacity in GPU blocks). Two ways to compute it:

- `replay` (default): the cache-only replay (`kvcache.replay`, one request at
  a time, no time model). Fragmentation is sampled once per request, just
  before its blocks are freed (its peak footprint), and averaged over requests.
- `sim`: the full simulator (`sim.engine.run.simulate`) with `num_gpu_blocks` =
  capacity; fragmentation is its time-weighted mean.

With KV offloading in the base config (`kv_offloading_size`), both modes run over the
host tier (the replay's with instantaneous transfers) and the rows gain its hits.

Points are independent and run in parallel on local processes.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

from kvsim.kvcache.manager import KVCacheManager
from kvsim.kvcache.offload.tier import HostTier
from kvsim.kvcache.profiles import DEFAULT_VERSION
from kvsim.kvcache.replay import Offload, ReplayRecord, replay
from kvsim.kvcache.sequence import Sequence
from kvsim.sim.engine.config import ConfigError, SimConfig, check_block_size
from kvsim.sim.studies.run_folder import staged_folder
from kvsim.sim.studies.sweep import WorkloadSpec, run_parallel

MODES = ("replay", "sim")
COLUMNS = (
    "policy",
    "capacity",
    "hit_rate",
    "block_hit_rate",
    "evicted_blocks",
    "mean_id_fragmentation",
    "mean_internal_fragmentation",
    "requests",
    "rejected",
)
OFFLOAD_COLUMNS = ("offload_hit_tokens", "total_hit_rate")  # with KV offloading on


class FreeSampler:
    """Samples a block manager's fragmentation as each request is freed (one group's or vLLM's
    hybrid groups'): it stands in for the manager's `free`, sampling before the blocks go."""

    def __init__(self, m: Any):
        self.m = m
        self.samples = 0
        self.id_frag_total = 0
        self.internal_frag_total = 0
        self._free = m.free
        m.free = self.free

    def free(self, seq: Sequence) -> None:
        m = self.m
        self.samples += 1
        self.id_frag_total += m.id_space_fragmentation()
        self.internal_frag_total += m.internal_fragmentation([seq])
        self._free(seq)


def check_points(capacities: list[int], policies: list[str], block_size: int, mode: str) -> None:
    """Raise ConfigError for a point no run could compute."""
    from kvsim.kvcache.eviction import check_policy

    if mode not in MODES:
        raise ConfigError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    if not capacities:
        raise ConfigError("no capacities given")
    for c in capacities:
        if isinstance(c, bool) or not isinstance(c, int):
            raise ConfigError(f"capacity must be an integer number of blocks, got {c!r}")
        if c < 2:
            raise ConfigError(f"capacity must be at least 2 blocks (block 0 is reserved), got {c}")
    if not policies:
        raise ConfigError("no policies given")
    for p in policies:
        try:
            check_policy(p)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    check_block_size(block_size)


def replay_offload(cfg: SimConfig) -> Offload | None:
    """The host tier `cfg` asks for, for a cache replay: `kv_offloading_size` GiB in chunks of the
    model's KV blocks, sized as `kvsim run` sizes it; None when offloading is off."""
    if cfg.kv_offloading_size is None:
        return None
    if cfg.offload_fs:
        raise ConfigError("the file tier (offload_fs) needs the clock of the full simulator: its probes and "
                          "I/O take time; use kvsim run, sweep or curve --mode sim")
    from kvsim.kvcache.offload.size import num_host_chunks
    from kvsim.sim.engine.cost_model import CostModel

    cost = CostModel.from_config(cfg)
    chunks = num_host_chunks(cfg.kv_offloading_size, cost.kv_bytes_per_block, cfg.tensor_parallel,
                             cfg.offload_blocks_per_chunk)
    tier = HostTier(chunks, cfg.offload_eviction_policy, store_threshold=cfg.offload_store_threshold)
    return Offload(tier, cfg.offload_blocks_per_chunk, cfg.offload_prompt_only)


def replay_point(
    workload: WorkloadSpec, policy: str, capacity: int, block_size: int,
    vllm_version: str = DEFAULT_VERSION, base: SimConfig | None = None,
) -> dict[str, Any]:
    """One point by cache-only replay (sequential, as `kvsim cache-replay`); over the host tier
    of `base`'s KV offloading, if on. A model `base` keeps in vLLM's hybrid KV-cache groups replays
    in them (`replay_manager`); fragmentation is sampled as each request is freed either way."""
    from kvsim.sim.engine.cost_model import CostModel
    from kvsim.sim.engine.run import replay_manager

    if base is not None and CostModel.from_config(base).layout is not None:
        m = replay_manager(base.replace(eviction=policy, block_size=block_size, vllm_version=vllm_version), capacity)
        block_size = m.block_size
    else:
        m = KVCacheManager(capacity, block_size, eviction=policy, vllm_version=vllm_version)
    sampler = FreeSampler(m)
    offload = replay_offload(base.replace(block_size=block_size)) if base is not None else None
    blocks = {"hit": 0, "prompt": 0}

    def count(rec: ReplayRecord) -> None:
        blocks["hit"] += rec.hit_tokens // block_size
        blocks["prompt"] += -(-rec.prompt_tokens // block_size)

    r = replay(workload.open(), m, 1, count, offload)
    n = sampler.samples or float("nan")
    row = {
        "policy": policy,
        "capacity": capacity,
        "hit_rate": r.hit_rate,
        "block_hit_rate": blocks["hit"] / blocks["prompt"] if blocks["prompt"] else 0.0,
        "evicted_blocks": r.evicted_blocks,
        "mean_id_fragmentation": sampler.id_frag_total / n,
        "mean_internal_fragmentation": sampler.internal_frag_total / n,
        "requests": r.requests,
        "rejected": r.rejected,
    }
    if offload is not None:
        row.update(offload_hit_tokens=r.offload_hit_tokens, total_hit_rate=r.total_hit_rate)
    return row


def sim_point(
    workload: WorkloadSpec,
    policy: str,
    capacity: int,
    block_size: int,
    base: SimConfig | None = None,
    vllm_version: str | None = None,
) -> dict[str, Any]:
    """One point by full simulation of `base` (default config) at this capacity and policy;
    `vllm_version`, when given, replaces base's."""
    from kvsim.sim.engine.run import simulate

    cfg = (base or SimConfig()).replace(
        num_gpu_blocks=capacity, eviction=policy, block_size=block_size
    )
    if vllm_version is not None:
        cfg = cfg.replace(vllm_version=vllm_version)
    s = simulate(workload.open(), cfg).summary
    row = {
        "policy": policy,
        "capacity": capacity,
        "hit_rate": s["hit_rate"],
        "block_hit_rate": s["block_hit_rate"],
        "evicted_blocks": s["evictions"],
        "mean_id_fragmentation": s["mean_id_fragmentation"],
        "mean_internal_fragmentation": s["mean_internal_fragmentation"],
        "requests": s["requests"],
        "rejected": s["rejected"],
    }
    if cfg.kv_offloading_size is not None:
        row.update(offload_hit_tokens=s["offload_hit_tokens"], total_hit_rate=s["total_hit_rate"])
    return row


def capacity_curve(
    workload: WorkloadSpec,
    capacities: list[int],
    policies: list[str],
    block_size: int = 16,
    mode: str = "replay",
    workers: int = 1,
    base: SimConfig | None = None,
    on_point: Callable[[dict[str, Any]], None] | None = None,
    vllm_version: str | None = None,
) -> pd.DataFrame:
    """Every (policy, capacity) point; rows sorted by policy (as given) then capacity.
    `vllm_version` defaults to base's (or 0.33)."""
    if vllm_version is None:
        vllm_version = base.vllm_version if base is not None else DEFAULT_VERSION
    check_points(capacities, policies, block_size, mode)
    offloading = base is not None and base.kv_offloading_size is not None
    if base is not None and offloading:  # fail here, not in a worker (a bad knob, an older release)
        base.replace(block_size=block_size, vllm_version=vllm_version).validate()
    caps = sorted(set(capacities))
    # largest capacities first: the slowest points start first and the pool drains evenly
    order = sorted(((p, c) for p in policies for c in caps), key=lambda pc: -pc[1])
    if mode == "replay":
        items = [(workload, p, c, block_size, vllm_version, base) for p, c in order]
        fn: Callable[..., dict[str, Any]] = replay_point
    else:
        items = [(workload, p, c, block_size, base, vllm_version) for p, c in order]
        fn = sim_point
    rows = run_parallel(fn, items, workers, (lambda _, row: on_point(row)) if on_point else None)
    rank = {p: i for i, p in enumerate(policies)}
    rows.sort(key=lambda r: (rank[r["policy"]], r["capacity"]))
    return pd.DataFrame(rows, columns=list(COLUMNS + OFFLOAD_COLUMNS if offloading else COLUMNS))


def format_table(df: pd.DataFrame, column: str = "hit_rate", percent: bool = True) -> str:
    """A capacity x policy text table of one column."""
    wide = df.pivot(index="capacity", columns="policy", values=column)[
        list(dict.fromkeys(df["policy"]))
    ]
    cells = [["capacity", *wide.columns]]
    for cap, row in wide.iterrows():
        fmt = (lambda v: f"{v * 100:.2f}") if percent else (lambda v: f"{v:,.1f}")
        cells.append([f"{cap:,}", *(fmt(v) for v in row)])
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells)


def plot_curve(
    df: pd.DataFrame, path: str | Path, workload: str, block_size: int, mode: str,
    ideal: float | None = None,
) -> None:
    """Hit rate (left) and mean id-space fragmentation as a share of the cache (right)
    against capacity (a log2 axis), one line per policy; `ideal`: the workload's hit rate with
    an infinite cache, drawn as the ceiling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_hit, ax_frag) = plt.subplots(1, 2, figsize=(11, 4.2))
    for policy, g in df.groupby("policy", sort=False):
        line = ax_hit.plot(g["capacity"], g["hit_rate"] * 100, marker="o", label=policy)[0]
        if "total_hit_rate" in g:
            ax_hit.plot(g["capacity"], g["total_hit_rate"] * 100, marker="^", linestyle="--",
                        color=line.get_color(), label=f"{policy} + host tier")
        frag = g["mean_id_fragmentation"] / (g["capacity"] - 1) * 100  # usable blocks
        ax_frag.plot(g["capacity"], frag, marker="o", label=policy)
    unit = f"GPU blocks of {block_size} tokens, log2"
    ax_hit.set(xlabel=f"cache capacity ({unit})", ylabel="prefix hit rate (% of prompt tokens)")
    ax_frag.set(
        xlabel=f"cache capacity ({unit})", ylabel="mean id-space holes (% of usable blocks)"
    )
    if ideal is not None:
        ax_hit.axhline(100 * ideal, color="0.3", ls="--", lw=1.2, label=f"ideal, an infinite cache ({ideal:.1%})")
    caps = sorted(df["capacity"].unique())
    for ax in (ax_hit, ax_frag):
        ax.grid(alpha=0.3)
        ax.set_xscale("log", base=2)
        ax.set_xticks(caps, [f"{c:,}" for c in caps])
        ax.minorticks_off()
    top = max(float(df["hit_rate"].max()), float(df.get("total_hit_rate", df["hit_rate"]).max()), ideal or 0.0)
    ax_hit.set_ylim(0, min(100.0, 100 * top * 1.15 + 2))  # room above the ceiling, but no empty page
    ax_hit.legend(title="eviction")
    fig.suptitle(f"Prefix hit rate vs cache capacity: {workload} ({mode})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_curve(
    df: pd.DataFrame, out_dir: str | Path, workload: str, block_size: int, mode: str,
    ideal: float | None = None,
) -> Path:
    """`curve.parquet` and `curve.png` in `out_dir`; returns the folder."""
    with staged_folder(out_dir) as out:  # whole or not at all
        df.to_parquet(out / "curve.parquet", index=False)
        plot_curve(df, out / "curve.png", workload, block_size, mode, ideal)
    return Path(out_dir)
