"""A P/D cluster run's folder (`kvsim run --prefill-replicas P --decode-replicas D`): the summary with
its `pd` section, each request's way through the pools, the plot, and one run folder a replica.

The folder holds `config.json`, `summary.json`, `paths.parquet` (a row a request: its replicas, the
times of its way and TTFT's parts: `sim.cluster.pd.PDCluster.paths_frame`), `pd.png` and
`replica-<i>/` (prefill replicas first), each a run folder as `kvsim run` writes one (`write_run`,
without plots). The result is read by its attributes (`sim.cluster.pd.PDResult`): studies do not
import the cluster.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvsim.sim.studies.cluster_folder import write_fleet
from kvsim.sim.studies.run_folder import read_summary, staged_folder
from kvsim.sim.studies.units import axis

PATHS = "paths.parquet"
PLOT = "pd.png"
PARTS = ("prefill_queue", "prefill", "decode_queue", "transfer", "promotion")


def write_pd(result: Any, out_dir: str | Path, plots: bool = True) -> Path:
    """Write a P/D cluster run's folder (see the module docstring), whole or not at all."""
    with staged_folder(out_dir) as out:
        write_fleet(result, out)
        result.paths.to_parquet(out / PATHS, index=False)
        if plots:
            plot_pd(result, out / PLOT)
    return Path(out_dir)


def is_pd_folder(folder: str | Path) -> bool:
    """Whether `folder` is a P/D cluster run's folder (its paths table, and a summary with the pd section)."""
    d = Path(folder)
    return (d / PATHS).is_file() and (d / "summary.json").is_file() and "pd" in read_summary(d)


def load_pd(folder: str | Path) -> Any:
    """A P/D run folder's summary and paths table, read back (`.summary`, `.paths`: what `plot_pd` and
    `kvsim report` read); a folder that is not one raises FileNotFoundError or ValueError naming it."""
    from types import SimpleNamespace

    import pandas as pd

    d = Path(folder)
    if not (d / PATHS).is_file():
        raise FileNotFoundError(f"{d}: not a P/D run folder (no {PATHS}; `kvsim run --prefill-replicas P "
                                "--decode-replicas D` writes one)")
    summary = read_summary(d)
    if not isinstance(summary.get("pd"), dict):
        raise ValueError(f"{d / 'summary.json'}: no pd section (not a P/D run's summary)")
    return SimpleNamespace(summary=summary, paths=pd.read_parquet(d / PATHS))


def plot_pd(result: Any, path: Path) -> None:
    """Two panels: the disaggregated requests' mean TTFT split into its parts, and the read times
    against the bytes read (the link's sharing shows as spread above the one-read line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = result.paths
    remote = paths[paths["remote"] & (paths["status"] == "finished")]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    means = [float(remote[part].mean()) if len(remote) else 0.0 for part in PARTS]
    means.append(float((remote["first_token"] - remote["decode_start"]).mean()) if len(remote) else 0.0)
    k, unit = axis(sum(means))  # (minutes where a queue took them, milliseconds where nothing waited)
    start = 0.0
    for label, value in zip([p.replace("_", " ") for p in PARTS] + ["first decode step"], means, strict=True):
        left.barh(["mean TTFT"], [value * k], left=[start * k], label=label)
        start += value
    left.set_xlabel(unit)
    left.set_title(f"TTFT of {len(remote):,} disaggregated requests")
    left.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=3)
    if len(remote):
        right.scatter(remote["read_bytes"] / 1e6, remote["transfer"] * 1e3, s=6)
    right.set_xlabel("MB read (one rank)")
    right.set_ylabel("transfer (ms)")
    right.set_title("reads")
    s = result.summary["pd"]
    fig.suptitle(f"{s['prefill_replicas']} prefill + {s['decode_replicas']} decode replicas, router {s['router']}, "
                 f"decider {s['decider']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
