"""A cluster's in-flight load table and imbalance: by hand, and equal to the dense computation they
replaced (a (changes x replicas) delta matrix, summed down, and the counts as floats), which held
four copies of the table at once."""

from __future__ import annotations

import numpy as np
import pandas as pd
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsim.sim.cluster.load import LoadChanges, imbalance, in_flight


def changes_of(events: list[tuple[float, int, int]]) -> LoadChanges:
    changes = LoadChanges()
    for event in events:
        changes.add(*event)
    return changes


def dense_in_flight(events: list[tuple[float, int, int]], num_replicas: int) -> pd.DataFrame:
    """The table as kvsim computed it before `sim.cluster.load`: a delta row per change, summed."""
    if not events:
        return pd.DataFrame({"time": np.zeros(0), **{f"replica_{i}": np.zeros(0, np.int64) for i in range(num_replicas)}})
    ev = sorted(events, key=lambda e: e[0])
    times = np.array([e[0] for e in ev])
    deltas = np.zeros((len(ev), num_replicas), np.int64)
    deltas[np.arange(len(ev)), [e[1] for e in ev]] = [e[2] for e in ev]
    counts = deltas.cumsum(axis=0)
    last = np.r_[times[1:] != times[:-1], True]
    return pd.DataFrame({"time": times[last], **{f"replica_{i}": counts[last, i] for i in range(num_replicas)}})


def float_imbalance(load: pd.DataFrame) -> dict[str, float | None]:
    """The imbalance as kvsim computed it before: the counts as a float matrix, its row means."""
    counts = load.drop(columns="time").to_numpy(np.float64)
    if len(counts) < 2:
        return {"imbalance_mean": None, "imbalance_peak": None}
    dt = np.diff(load["time"].to_numpy())
    counts = counts[:-1]
    mean = counts.mean(axis=1)
    busy = (mean > 0) & (dt > 0)
    if not busy.any():
        return {"imbalance_mean": None, "imbalance_peak": None}
    ratio = counts[busy].max(axis=1) / mean[busy]
    return {"imbalance_mean": float((ratio * dt[busy]).sum() / dt[busy].sum()), "imbalance_peak": float(ratio.max())}


def test_in_flight_and_imbalance_by_hand():
    load = in_flight(changes_of([(0.0, 0, 1), (0.0, 1, 1), (1.0, 0, 1), (2.0, 0, -1), (2.0, 0, -1), (3.0, 1, -1)]), 2)
    assert load.to_dict("list") == {"time": [0.0, 1.0, 2.0, 3.0], "replica_0": [1, 2, 0, 0], "replica_1": [1, 1, 1, 0]}
    # [0, 1): 1 / 1; [1, 2): 2 / 1.5; [2, 3): 1 / 0.5
    assert imbalance(load) == {"imbalance_mean": (1 + 4 / 3 + 2) / 3, "imbalance_peak": 2.0}


def test_changes_out_of_time_order_are_sorted_stably_and_an_idle_replica_stays_at_zero():
    # a finish recorded at its step's end (3.0) before a dispatch at 1.0; replica 2 never gets one
    load = in_flight(changes_of([(0.0, 1, 1), (3.0, 1, -1), (1.0, 0, 1), (1.0, 0, -1), (1.0, 0, 1)]), 3)
    assert load.to_dict("list") == {"time": [0.0, 1.0, 3.0], "replica_0": [0, 1, 1], "replica_1": [1, 1, 0],
                                    "replica_2": [0, 0, 0]}
    assert load.dtypes.tolist() == [np.float64, np.int64, np.int64, np.int64]


def test_no_changes_give_an_empty_table_of_the_same_columns_and_no_imbalance():
    load = in_flight(LoadChanges(), 2)
    pd.testing.assert_frame_equal(load, dense_in_flight([], 2))
    assert imbalance(load) == {"imbalance_mean": None, "imbalance_peak": None}


# times from a few values so that many changes share one; deltas of either sign
EVENTS = st.lists(st.tuples(st.sampled_from([0.0, 0.05, 0.1, 0.3, 1.0 / 3, 2.5, 7.0]), st.integers(0, 5),
                            st.sampled_from([1, -1])), max_size=60)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(events=EVENTS, extra=st.integers(0, 3))
def test_the_table_and_imbalance_equal_the_dense_computation(events: list[tuple[float, int, int]], extra: int):
    num_replicas = 6 + extra  # some replicas never change
    load = in_flight(changes_of(events), num_replicas)
    pd.testing.assert_frame_equal(load, dense_in_flight(events, num_replicas), check_exact=True)
    assert imbalance(load) == float_imbalance(load)
