"""A cluster's in-flight load: each replica's count of requests dispatched and not yet seen
finished, as the router counts it; its table over time (`in_flight`) and the load imbalance over
the run (`imbalance`).

The changes are kept as three packed columns (`LoadChanges`), not a tuple each: a long run records
two a request, and tuples would hold tens of megabytes the garbage collector walks. The table has a
row per distinct time and a column per replica, so it is built one replica's column at a time into
the one array the table keeps: its size (times x replicas) is the only memory that grows with both.
"""

from __future__ import annotations

from array import array

import numpy as np
import pandas as pd


class LoadChanges:
    """The (time, replica, +1 or -1) changes of the replicas' in-flight counts, in the order they
    were recorded (a finish may be recorded at a step's end, ahead of the clock)."""

    def __init__(self) -> None:
        self.times = array("d")
        self.replicas = array("i")
        self.deltas = array("b")

    def add(self, time: float, replica: int, delta: int) -> None:
        """`replica`'s count changes by `delta` at `time`."""
        self.times.append(time)
        self.replicas.append(replica)
        self.deltas.append(delta)

    def __len__(self) -> int:
        return len(self.times)


def in_flight(changes: LoadChanges, num_replicas: int) -> pd.DataFrame:
    """Each replica's in-flight requests (dispatched, not yet finished) from each change on: a row
    per distinct time (`time`, then `replica_<i>`), the counts after every change at that time (the
    changes taken in time order, those at one time in the order recorded)."""
    order = np.argsort(np.frombuffer(changes.times, np.float64), kind="stable")
    times = np.frombuffer(changes.times, np.float64)[order]
    replicas = np.frombuffer(changes.replicas, np.intc)[order]
    deltas = np.frombuffer(changes.deltas, np.int8)[order]
    new = np.r_[True, times[1:] != times[:-1]] if len(times) else np.zeros(0, bool)
    row = np.cumsum(new) - 1  # each change's row: the index of its time among the distinct ones
    num_rows = int(new.sum())
    counts = np.zeros((num_replicas, num_rows), np.int64)  # the table's block: a replica a row
    by_replica = np.argsort(replicas, kind="stable")  # each replica's changes, in time order
    starts = np.searchsorted(replicas[by_replica], np.arange(num_replicas + 1))
    for i in range(num_replicas):
        mine = by_replica[starts[i] : starts[i + 1]]
        if not len(mine):
            continue
        total = np.cumsum(deltas[mine], dtype=np.int64)
        rows = row[mine]
        last = np.r_[rows[1:] != rows[:-1], True]  # the last of its changes at each time
        at = np.zeros(num_rows, np.int64)  # 1 + the index of the last change at or before each row
        at[rows[last]] = np.arange(1, int(last.sum()) + 1)
        np.maximum.accumulate(at, out=at)
        counts[i] = np.r_[0, total[last]][at]
    table = pd.DataFrame(counts.T, columns=[f"replica_{i}" for i in range(num_replicas)], copy=False)
    table.insert(0, "time", times[new])
    return table


def imbalance(load: pd.DataFrame) -> dict[str, float | None]:
    """Load imbalance over the run: at each moment, the most in-flight requests on one replica over
    the mean per replica; `imbalance_mean` its time average over the moments any request is in
    flight, `imbalance_peak` its largest value (1.0: perfectly even; N: all on one of N). Counts are
    summed as integers (exact, as a float sum of them is) and read from the table without a copy."""
    if len(load) < 2:
        return {"imbalance_mean": None, "imbalance_peak": None}
    counts = load.iloc[:-1, 1:].to_numpy()
    dt = np.diff(load["time"].to_numpy())
    mean = counts.sum(axis=1) / counts.shape[1]
    busy = (mean > 0) & (dt > 0)
    if not busy.any():
        return {"imbalance_mean": None, "imbalance_peak": None}
    ratio = counts.max(axis=1)[busy] / mean[busy]
    return {"imbalance_mean": float((ratio * dt[busy]).sum() / dt[busy].sum()), "imbalance_peak": float(ratio.max())}
