"""Every metric a run reports, defined once: per-step and per-request logs, and the summary.

The logs are preallocated numpy columns that double when full, so recording a
step or a request costs a few array stores (no per-step dicts or DataFrames).
Summary metrics (DESIGN.md, "sim: the engine"):

- hit rate (token level): prompt tokens served from the prefix cache at a
  request's first admission / prompt tokens of admitted requests;
- block hit rate: hit blocks / prompt blocks (ceil(prompt / block size)),
  over the same requests;
- fragmentation: id-space (holes below the highest used block id, as the
  defragmenter sees it) and internal (allocated slots not holding a token),
  both time-weighted means over steps;
- evictions, preemptions (by kind), swapped blocks, CoW copies, defrag moves;
- per request: TTFT, TPOT, end-to-end latency, queueing delay; throughput and
  goodput (requests meeting the SLOs per second; None without an SLO);
- offered against served rate, and whether (and since when) the run was overloaded;
- per step: running / waiting / swapped, free / cached / used blocks.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import numpy as np
import pandas as pd

# Request status codes (a request group takes the worst status of its samples).
PENDING, FINISHED, TRUNCATED, REJECTED = 0, 1, 2, 3
STATUS = ("pending", "finished", "truncated", "rejected")
# Why a request was rejected or truncated (0: it was not).
REASONS = (
    "",
    "prompt_exceeds_cache",  # its prompt needs more blocks than the cache has
    "prompt_exceeds_batch",  # chunked prefill off and prompt > max_num_batched_tokens
    "n_exceeds_max_num_seqs",  # more parallel samples than max_num_seqs
    "context_exceeds_cache",  # prompt + output grew past what the cache can hold
    "prompt_exceeds_max_model_len",  # no room for an output token within max_model_len
    # vLLM 0.33 refuses it before it is queued: "The decoder prompt cannot be empty"
    # (vllm/v1/engine/input_processor.py, InputProcessor._validate_prompt_len)
    "empty_prompt",
)
REASON_CODE = {r: i for i, r in enumerate(REASONS)}
OVERLOAD_SHARE = 0.9  # a run that serves under this share of the offered rate is overloaded
PERCENTILES = (50, 90, 99)


class Columns:
    """Named numpy columns of one length, grown by doubling; `frame()` trims to the rows used."""

    def __init__(self, schema: dict[str, Any], capacity: int = 1024):
        self.rows = 0
        self.capacity = capacity
        self.cols: dict[str, np.ndarray] = {k: self._empty(dt, capacity) for k, dt in schema.items()}
        for k, v in self.cols.items():
            setattr(self, k, v)

    @staticmethod
    def _empty(dtype: Any, n: int) -> np.ndarray:
        return np.full(n, np.nan) if np.dtype(dtype).kind == "f" else np.zeros(n, dtype=dtype)

    def next_row(self) -> int:
        """Index of a fresh row (grows the columns when full)."""
        i = self.rows
        if i == self.capacity:
            self.capacity *= 2
            for k, v in self.cols.items():
                new = self._empty(v.dtype, self.capacity)
                new[:i] = v
                self.cols[k] = new
                setattr(self, k, new)
        self.rows = i + 1
        return i

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame({k: v[: self.rows] for k, v in self.cols.items()})


STEP_COLUMNS: dict[str, Any] = {
    "time": np.float64,  # step start, s
    "duration": np.float64,  # step length from the cost model, s
    # queue lengths and blocks are taken at the end of the step, after finished requests are freed
    "running": np.int32,  # sequences in RUNNING
    "waiting": np.int32,  # requests waiting (new or recompute-preempted)
    "swapped": np.int32,  # sequences swapped out to CPU
    "scheduled_seqs": np.int32,  # sequences computed this step
    "prefill_tokens": np.int32,  # new tokens of prefilling sequences
    "decode_tokens": np.int32,  # one per decoding sequence
    "context_tokens": np.int64,  # sum of scheduled sequences' lengths after the step
    "free_blocks": np.int32,  # GPU blocks in the free set (cached ones included)
    "cached_blocks": np.int32,  # free blocks still holding a cached prefix
    "used_blocks": np.int32,  # GPU blocks referenced by a sequence
    "id_fragmentation": np.int32,  # max used block id - used blocks
    "internal_fragmentation": np.int64,  # allocated slots of running sequences not holding a token
    "evictions": np.int32,  # cached blocks reused this step
    "preempt_recompute": np.int32,
    "preempt_swap": np.int32,
    "copy": np.int32,  # block ops this step, by kind
    "swap_out": np.int32,
    "swap_in": np.int32,
    "move": np.int32,
    "admitted": np.int32,  # requests admitted for the first time
    "admitted_prompt_tokens": np.int64,  # their prompt tokens
    "admitted_hit_tokens": np.int64,  # of which served from the prefix cache
    "finished": np.int32,  # requests done (any status) this step
}
STEP_FIELDS = tuple(STEP_COLUMNS)


class StepTable(Protocol):
    """What `summarize` reads of a steps table: a DataFrame, or a streamed run's file
    (`sim.engine.step_log.StepFile`) read a column at a time."""

    empty: bool

    def __len__(self) -> int: ...

    def __getitem__(self, name: str) -> pd.Series: ...


REQUEST_COLUMNS: dict[str, Any] = {
    "arrival": np.float64,  # s; for a closed-loop session turn, when it was released
    "prompt_tokens": np.int32,
    "output_len": np.int32,  # tokens asked for, per sample
    "n": np.int16,  # parallel samples
    "priority": np.int32,
    "first_scheduled": np.float64,  # start of the step that first scheduled it
    "first_token": np.float64,  # end of the step that completed its prefill
    "finish": np.float64,  # end of the step that sampled its last token (or dropped it)
    # the engine step (numbered as in the steps table; with a fixed step time, k for the
    # step starting at k * step_time) that first scheduled it, sampled its first token, ended it
    "first_scheduled_step": np.float64,
    "first_token_step": np.float64,
    "finish_step": np.float64,
    "hit_tokens": np.int32,  # prompt tokens served from cache at first admission (each sample's, summed, when n > 1 fans out)
    "output_tokens": np.int64,  # tokens sampled, all samples together
    "preemptions": np.int32,
    "status": np.int8,  # index into STATUS
    "reason": np.int8,  # index into REASONS
}


STEP_INDEX_COLUMNS = ("first_scheduled_step", "first_token_step", "finish_step")


class GroupUsage:
    """Blocks each KV-cache group holds after each step (vLLM's hybrid groups: one column a group),
    one row a row of the steps table; `frame` names the columns `held_0`, `held_1`, ..."""

    def __init__(self, num_groups: int):
        from array import array

        self.columns = [array("q") for _ in range(num_groups)]

    def add(self, held: list[int]) -> None:
        for column, n in zip(self.columns, held, strict=True):
            column.append(n)

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame({f"held_{g}": np.frombuffer(c, dtype=np.int64) if len(c) else np.zeros(0, np.int64)
                             for g, c in enumerate(self.columns)})


class RequestLog(Columns):
    """One row per request, added at arrival; ids are kept in a plain list."""

    def __init__(self, capacity: int = 1024):
        super().__init__(REQUEST_COLUMNS, capacity)
        self.ids: list[str] = []

    def add(self, rid: str, arrival: float, prompt_tokens: int, output_len: int, n: int, priority: int) -> int:
        """A row for a newly arrived request; returns its index."""
        i = self.next_row()
        self.ids.append(rid)
        self.arrival[i] = arrival
        self.prompt_tokens[i] = prompt_tokens
        self.output_len[i] = output_len
        self.n[i] = n
        self.priority[i] = priority
        return i

    def frame(self) -> pd.DataFrame:
        """The per-request table with derived latencies (see `latencies`), made in one constructor
        (a cluster builds one a replica; column by column, pandas' per-call cost was most of it)."""
        cols: dict[str, Any] = {"id": pd.array(self.ids, dtype="string")}
        cols.update((k, v[: self.rows]) for k, v in self.cols.items())
        cols["status"] = pd.Categorical.from_codes(cols["status"], STATUS)
        cols["reason"] = pd.Categorical.from_codes(cols["reason"], REASONS)
        for col in STEP_INDEX_COLUMNS:  # NaN (never) -> <NA>
            cols[col] = pd.array(cols[col], dtype="Int64")
        cols.update(latencies(cols["arrival"], cols["first_scheduled"], cols["first_token"], cols["finish"],
                              cols["output_len"]))
        return pd.DataFrame(cols)


def latencies(arrival: np.ndarray, first_scheduled: np.ndarray, first_token: np.ndarray, finish: np.ndarray,
              output_len: np.ndarray) -> dict[str, np.ndarray]:
    """The per-request latency columns, in seconds (NaN where undefined), from the request columns.

    ttft = first_token - arrival; tpot = (finish - first_token) / (output_len - 1)
    (time per output token after the first, per sample); e2e = finish - arrival;
    queueing = first_scheduled - arrival.
    """
    decode = (output_len - 1).astype(np.float64)
    decode[decode <= 0] = np.nan
    return {"ttft": first_token - arrival, "tpot": (finish - first_token) / decode, "e2e": finish - arrival,
            "queueing": first_scheduled - arrival}


# ------------------------------------------------------------------ summary


def prefix_hits(requests: pd.DataFrame, block_size: int, fanned_out: bool = True) -> dict[str, Any]:
    """Prompt tokens scheduled by admitted requests (once a sample when n > 1 fans out, else once)
    and the prefix hit rates over them: token level, prompt tokens served from cache at first
    admission / prompt tokens scheduled; block level, hit blocks / prompt blocks (ceil(prompt / block size))."""
    adm = requests["first_scheduled"].notna().to_numpy()
    prompts = requests["prompt_tokens"].to_numpy()[adm].astype(np.int64)
    times = requests["n"].to_numpy()[adm].astype(np.int64) if fanned_out else 1
    total = int((prompts * times).sum())
    blocks = int((-(-prompts // block_size) * times).sum())
    hits = requests["hit_tokens"].to_numpy()[adm]
    return {"prompt_tokens": total, "hit_rate": float(hits.sum()) / total if total else 0.0,
            "block_hit_rate": float((hits // block_size).sum()) / blocks if blocks else 0.0}


def time_mean(steps: StepTable, column: str, w: np.ndarray | None = None) -> float:
    """Mean of a per-step quantity weighted by step duration (a time average); `w`: the
    duration column, if the caller has it already (a streamed table reads it from disk)."""
    w = steps["duration"].to_numpy() if w is None else w
    total = w.sum()
    return float((steps[column].to_numpy() * w).sum() / total) if total > 0 else 0.0


def percentiles(values: pd.Series | np.ndarray, name: str) -> dict[str, float | None]:
    """`name_p50`, `_p90`, `_p99` and `_mean` of the non-NaN values (None if there are none)."""
    v = np.asarray(values, dtype=np.float64)
    v = v[~np.isnan(v)]
    out: dict[str, float | None] = {}
    for p in PERCENTILES:
        out[f"{name}_p{p}"] = float(np.percentile(v, p)) if len(v) else None
    out[f"{name}_mean"] = float(v.mean()) if len(v) else None
    return out


def meets_slo(requests: pd.DataFrame, slo_ttft: float | None, slo_tpot: float | None) -> pd.Series:
    """Finished requests whose TTFT and TPOT are within the SLOs (an unset SLO always holds;
    a one-token answer has no TPOT and meets any TPOT SLO)."""
    ok = requests["status"] == "finished"
    if slo_ttft is not None:
        ok &= requests["ttft"] <= slo_ttft
    if slo_tpot is not None:
        ok &= requests["tpot"].isna() | (requests["tpot"] <= slo_tpot)
    return ok


def slo_figures(requests: pd.DataFrame, slo_ttft: float | None, slo_tpot: float | None,
                span: float) -> dict[str, float | None]:
    """`goodput_rps` (requests meeting both SLOs over the `span` seconds) and `slo_attainment` (their
    share of all requests); both None without targets (goodput is then not the throughput)."""
    if slo_ttft is None and slo_tpot is None:
        return {"goodput_rps": None, "slo_attainment": None}
    good = int(meets_slo(requests, slo_ttft, slo_tpot).sum())
    return {"goodput_rps": good / span if span else 0.0,
            "slo_attainment": good / len(requests) if len(requests) else 0.0}


def load_figures(steps: StepTable, requests: pd.DataFrame, served_rps: float) -> dict[str, Any]:
    """Offered against served. `offered_rps`: arrivals over their window, (n - 1) / (last - first)
    as `kvsim workload stats` counts it (None when all arrive at once); `served_rps`: finished
    requests over the run's span. `overloaded` when it served under `OVERLOAD_SHARE` of the offered
    rate; `overloaded_since_s` (seconds after the first arrival): from when the waiting queue never
    emptied again before the last arrival (None when not overloaded)."""
    out: dict[str, Any] = {"offered_rps": None, "served_rps": served_rps, "overloaded": False, "overloaded_since_s": None}
    if len(requests) < 2:
        return out
    arrivals = requests["arrival"].to_numpy()
    first, last = float(arrivals.min()), float(arrivals.max())
    if last <= first:
        return out
    out["offered_rps"] = (len(arrivals) - 1) / (last - first)
    if served_rps >= OVERLOAD_SHARE * out["offered_rps"] or not len(steps):
        return out
    out["overloaded"] = True
    times = np.asarray(steps["time"])
    within = times <= last
    empty = np.flatnonzero((np.asarray(steps["waiting"]) == 0) & within)
    after = int(empty[-1]) + 1 if len(empty) else 0  # the first step of the run that never emptied
    out["overloaded_since_s"] = float(times[min(after, len(times) - 1)]) - first
    return out


def codes(column: pd.Series, names: tuple[str, ...]) -> np.ndarray:
    """Each row's index into `names` (-1 for a value not among them): read off a categorical of
    exactly those names, as `RequestLog.frame` makes its status and reason columns."""
    if isinstance(column.dtype, pd.CategoricalDtype) and tuple(column.cat.categories) == names:
        return column.cat.codes.to_numpy()
    return pd.Index(names).get_indexer(column.to_numpy(dtype=object))


def duration(steps: StepTable, requests: pd.DataFrame) -> float:
    """Simulated span, s: first arrival to the end of the last step."""
    if steps.empty or requests.empty:
        return 0.0
    end = float(steps["time"].iloc[-1] + steps["duration"].iloc[-1])
    return max(end - float(requests["arrival"].min()), 0.0)


def summarize(
    steps: StepTable,
    requests: pd.DataFrame,
    *,
    block_size: int,
    num_gpu_blocks: int,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
    counters: dict[str, int] | None = None,
    fanned_out: bool = True,
) -> dict[str, Any]:
    """The run's summary: one flat JSON-friendly dict (see the module docstring).

    `counters` adds totals the logs do not hold (CoW copies, swapped blocks, ...); `fanned_out`:
    a request with n > 1 ran as n requests, each scheduling its prompt (else its samples forked).
    """
    span = duration(steps, requests)
    status = codes(requests["status"], STATUS)
    done = status == STATUS.index("finished")
    reason = codes(requests["reason"], REASONS)
    by_status = np.bincount(status[status >= 0], minlength=len(STATUS))
    by_reason = np.bincount(reason[reason >= 0], minlength=len(REASONS))
    usable = num_gpu_blocks - 1
    out_tokens = int(requests["output_tokens"].sum())
    s: dict[str, Any] = {
        "requests": len(requests),
        "finished": int(by_status[STATUS.index("finished")]),
        "truncated": int(by_status[STATUS.index("truncated")]),
        "rejected": int(by_status[STATUS.index("rejected")]),
    }
    for i, name in enumerate(REASONS[1:], 1):
        s[f"dropped_{name}"] = int(by_reason[i])
    hits = prefix_hits(requests, block_size, fanned_out)
    s.update(
        steps=len(steps),
        duration_s=span,
        prompt_tokens=hits["prompt_tokens"],
        hit_tokens=int(requests["hit_tokens"].sum()),
        hit_rate=hits["hit_rate"],
        block_hit_rate=hits["block_hit_rate"],
        output_tokens=out_tokens,
        throughput_rps=int(done.sum()) / span if span else 0.0,
        output_tokens_per_s=out_tokens / span if span else 0.0,
    )
    for col in ("ttft", "tpot", "e2e", "queueing"):
        s.update(percentiles(requests[col].to_numpy()[done], col))  # a column at a time: no copy of the table
    s.update(load_figures(steps, requests, s["throughput_rps"]))
    s.update(slo_figures(requests, slo_ttft, slo_tpot, span))
    s["evictions"] = int(steps["evictions"].sum())
    s["preemptions_recompute"] = int(steps["preempt_recompute"].sum())
    s["preemptions_swap"] = int(steps["preempt_swap"].sum())
    s["preemptions"] = s["preemptions_recompute"] + s["preemptions_swap"]
    s["swapped_out_blocks"] = int(steps["swap_out"].sum())
    s["swapped_in_blocks"] = int(steps["swap_in"].sum())
    s["cow_copies"] = int(steps["copy"].sum())
    s["defrag_moves"] = int(steps["move"].sum())
    used = steps["used_blocks"]
    s["num_gpu_blocks"] = num_gpu_blocks
    s["peak_used_blocks"] = int(used.max()) if len(used) else 0
    s["peak_block_usage"] = s["peak_used_blocks"] / usable
    w = steps["duration"].to_numpy() if len(steps) else None
    s["mean_block_usage"] = time_mean(steps, "used_blocks", w) / usable if len(steps) else 0.0
    s["mean_id_fragmentation"] = time_mean(steps, "id_fragmentation", w) if len(steps) else 0.0
    s["mean_internal_fragmentation"] = time_mean(steps, "internal_fragmentation", w) if len(steps) else 0.0
    if counters:
        s.update(counters)
    return {k: _plain(v) for k, v in s.items()}


def _plain(v: Any) -> Any:
    """A JSON-safe value: numpy scalars to Python, NaN to None."""
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, float) and math.isnan(v):
        return None
    return v
