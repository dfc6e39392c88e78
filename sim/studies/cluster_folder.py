"""A cluster run's folder (`kvsim run --replicas N`): the cluster's summary, the requests each
replica received, the load plot, and one run folder a replica.

The folder holds `config.json`, `summary.json` (its `cluster` section: `sim.cluster.run`),
`received.parquet` (id, arrival: when it reached its replica, replica), `load.parquet` (each
replica's in-flight requests from each change on), `cluster.png`, and `replica-<i>/`, each a run
folder as `kvsim run` writes one (`write_run`, without plots: `kvsim report` draws them). The result
is read by its attributes (`sim.cluster.run.ClusterResult`), so this layer does not import it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from kvsim.sim.studies.run_folder import staged_folder, write_run

RECEIVED = "received.parquet"
LOAD = "load.parquet"
PLOT = "cluster.png"


def write_cluster(result: Any, out_dir: str | Path, plots: bool = True) -> Path:
    """Write a cluster run's folder (see the module docstring), whole or not at all."""
    with staged_folder(out_dir) as out:
        (out / "config.json").write_text(json.dumps(result.config.to_dict(), indent=2, sort_keys=True) + "\n")
        (out / "summary.json").write_text(json.dumps(result.summary, indent=2) + "\n")
        result.received.to_parquet(out / RECEIVED, index=False)
        result.load.to_parquet(out / LOAD, index=False)
        for i, replica in enumerate(result.replicas):
            write_run(replica, out / f"replica-{i}", plots=False)
        if plots:
            plot_cluster(result, out / PLOT)
    return Path(out_dir)


def hit_rate_by_time(requests: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """A replica's cumulative token-level hit rate at each first admission, in time order."""
    adm = requests.loc[requests["first_scheduled"].notna()].sort_values("first_scheduled", kind="stable")
    prompt = np.cumsum((adm["prompt_tokens"] * adm["n"]).to_numpy(np.int64))
    hit = np.cumsum(adm["hit_tokens"].to_numpy(np.int64))
    return adm["first_scheduled"].to_numpy(), np.divide(hit, prompt, out=np.zeros(len(hit)), where=prompt > 0)


def plot_cluster(result: Any, path: str | Path) -> None:
    """Each replica's in-flight requests (top) and cumulative prefix hit rate (bottom) over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c, s = result.config, result.summary["cluster"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6.4), sharex=True, height_ratios=(3, 2))
    load = result.load
    for i, replica in enumerate(result.replicas):
        top.step(load["time"], load[f"replica_{i}"], where="post", lw=0.8, label=f"replica {i}")
        t, rate = hit_rate_by_time(replica.requests)
        bottom.plot(t, rate * 100, lw=0.9, label=f"replica {i}")
    imb = s["imbalance_mean"]
    top.set_ylabel("in-flight requests")
    top.set_title(f"{result.workload}: {c.replicas} x {c.model} on {c.gpu}, router {c.router}"
                  + (f", imbalance {imb:.2f} (max / mean)" if imb is not None else ""))
    bottom.set_ylabel("prefix hit rate, %")
    bottom.set_xlabel("time, s")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    top.legend(loc="upper right", fontsize=8, ncol=min(c.replicas, 4))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
