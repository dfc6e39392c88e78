"""A cluster run's folder (`kvsim run --replicas N`): the cluster's summary, the requests each
replica received, the load plot, and one run folder a replica.

The folder holds `config.json`, `summary.json` (its `cluster` section: `sim.cluster.run`),
`received.parquet` (id, arrival: when it reached its replica, replica), `load.parquet` (each
replica's in-flight requests from each change on), `cluster.png`, and `replica-<i>/`, each a run
folder as `kvsim run` writes one (`write_run`, without plots: `kvsim report` draws them). The result
is read by its attributes (`sim.cluster.run.ClusterResult`), so this layer does not import it.
Read back: the whole run (`load_cluster`: `kvsim report`), the cluster section (`kvsim compare`), and
one replica alone, its received requests and the config it replays under (`kvsim conform
--cluster-run`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from kvsim.sim.engine.config import SimConfig
from kvsim.sim.engine.run import RunResult
from kvsim.sim.studies.run_folder import (
    load_run,
    read_json_object,
    read_summary,
    read_table,
    staged_folder,
    write_run,
)
from kvsim.workloads.request import Request, Workload

RECEIVED = "received.parquet"
LOAD = "load.parquet"
PLOT = "cluster.png"


def write_cluster(result: Any, out_dir: str | Path, plots: bool = True) -> Path:
    """Write a cluster run's folder (see the module docstring), whole or not at all."""
    with staged_folder(out_dir) as out:
        write_fleet(result, out)
        result.received.to_parquet(out / RECEIVED, index=False)
        result.load.to_parquet(out / LOAD, index=False)
        if plots:
            plot_cluster(result, out / PLOT)
    return Path(out_dir)


def write_fleet(result: Any, out: Path) -> None:
    """What every fleet's folder holds (a cluster's, a P/D cluster's): `config.json`, `summary.json`
    and `replica-<i>/`, each replica's run folder without plots."""
    (out / "config.json").write_text(json.dumps(result.config.to_dict(), indent=2, sort_keys=True) + "\n")
    (out / "summary.json").write_text(json.dumps(result.summary, indent=2) + "\n")
    for i, replica in enumerate(result.replicas):
        write_run(replica, out / f"replica-{i}", plots=False)


def is_cluster_folder(folder: str | Path) -> bool:
    """Whether `folder` is a cluster run's folder (its summary.json has the cluster section)."""
    d = Path(folder)
    return (d / RECEIVED).is_file() and (d / "summary.json").is_file() and "cluster" in read_summary(d)


def cluster_section(folder: str | Path) -> dict[str, Any]:
    """A cluster run folder's `cluster` section (per replica and overall figures, imbalance); a
    folder that is not one raises FileNotFoundError or ValueError naming it."""
    d = Path(folder)
    return _section(d, _summary(d))


def _summary(d: Path) -> dict[str, Any]:
    """Cluster run folder `d`'s summary; a folder without the received requests is not one."""
    if not (d / RECEIVED).is_file():
        raise FileNotFoundError(f"{d}: not a cluster run folder (no {RECEIVED}; `kvsim run --replicas N` writes one)")
    return read_summary(d)


def _section(d: Path, summary: dict[str, Any]) -> dict[str, Any]:
    """The `cluster` section of folder `d`'s `summary`, checked."""
    section = summary.get("cluster")
    if not isinstance(section, dict) or not isinstance(section.get("per_replica"), list):
        raise ValueError(f"{d / 'summary.json'}: no cluster section (not a cluster run's summary)")
    return section


@dataclass(frozen=True)
class ClusterRun:
    """A cluster run read back from its folder (`load_cluster`), with the attributes of a
    `sim.cluster.run.ClusterResult` that `kvsim report` prints and `plot_cluster` draws."""

    config: SimConfig
    workload: str
    summary: dict[str, Any]
    load: pd.DataFrame
    replicas: list[RunResult]


def load_cluster(folder: str | Path) -> ClusterRun:
    """A cluster run folder read back: its config, summary, load table and each replica's run folder;
    a folder that is not a cluster run's, or a file of it missing or bad, raises naming it."""
    d = Path(folder)
    summary = _summary(d)
    section = _section(d, summary)
    if not (d / LOAD).is_file():
        raise FileNotFoundError(f"{d}: not a complete cluster run folder (no {LOAD})")
    config = SimConfig.from_run_config(read_json_object(d / "config.json"), source=str(d / "config.json"))
    return ClusterRun(config, str(summary.get("workload", d.name)), summary, read_table(d / LOAD),
                      [load_run(d / f"replica-{i}") for i in range(len(section["per_replica"]))])


def replica_config(folder: str | Path, replica: int) -> SimConfig:
    """The config replica `replica` of a cluster run folder replays under alone: its run folder's
    (the cache size resolved), with one replica and load 1 (its arrivals are the times requests
    reached it). A folder that is not a cluster run's, or a replica it lacks, raises naming it."""
    d = Path(folder)
    num_replicas = len(cluster_section(d)["per_replica"])
    if not 0 <= replica < num_replicas:
        raise ValueError(f"--replica {replica}: {d} has {num_replicas} replicas (0 to {num_replicas - 1})")
    return load_run(d / f"replica-{replica}").config.replace(replicas=1, load=1.0)


def load_received(folder: str | Path, replica: int, workload: Iterable[Request]) -> Workload:
    """The requests replica `replica` of a cluster run folder received (`received.parquet`), each
    taken by id from `workload`, the one the run was made with, as they reached it
    (`Workload.as_received`): with `replica_config`, what `kvsim conform --cluster-run` compares
    with vLLM. A request the workload lacks, or whose prompt length differs from the run's, raises."""
    d = Path(folder)
    run = load_run(d / f"replica-{replica}")
    got = read_table(d / RECEIVED)
    got = got[got["replica"] == replica]
    wanted = set(got["id"])
    by_id = {r.id: r for r in workload if r.id in wanted}
    prompts = dict(zip(run.requests["id"], run.requests["prompt_tokens"], strict=True))
    name = getattr(workload, "name", "the workload")
    for rid in got["id"]:
        if rid not in by_id:
            raise ValueError(f"request {rid!r}, which replica {replica} received, is not in {name}: give the "
                             "workload the cluster run was made with")
        if by_id[rid].prompt_len != prompts.get(rid):
            raise ValueError(f"request {rid!r} has a {by_id[rid].prompt_len}-token prompt in {name} but "
                             f"{prompts.get(rid)} in {d}: not the workload the cluster run was made with")
    received = [(float(t), by_id[rid]) for t, rid in zip(got["arrival"], got["id"], strict=True)]
    return Workload.as_received(received, f"{run.workload}-replica-{replica}")


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
    bottom.set_ylabel("prefix hit rate so far, %")
    bottom.set_xlabel("time, s")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    top.legend(loc="upper right", fontsize=8, ncol=min(c.replicas, 4))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
