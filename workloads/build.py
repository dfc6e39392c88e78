"""Synthetic workloads by kind name: each generator with command-line style options mapped
onto its own keywords (`kvsim workload generate` and the sweeps build workloads this way)."""

from __future__ import annotations

import math
from typing import Any

from kvsim.workloads.arrivals import make_arrivals
from kvsim.workloads.default import default_workload
from kvsim.workloads.lengths import parse_lengths
from kvsim.workloads.names import KINDS as KINDS  # re-exported: the kinds build_workload takes
from kvsim.workloads.request import Workload
from kvsim.workloads.sessions import agent, multi_turn
from kvsim.workloads.shapes import few_shot, parallel, shared_prefix

# CLI option -> keyword of each generator (options a kind does not take are rejected)
OPTION_KEYWORDS: dict[str, dict[str, str]] = {
    "shared-prefix": {
        "prefix_len": "prefix_len",
        "user_len": "user_len",
        "output_len": "output_len",
        "num_prefixes": "num_prefixes",
        "zipf": "zipf",
    },
    "multi-turn": {
        "prefix_len": "system_len",
        "user_len": "user_len",
        "output_len": "output_len",
        "num_prefixes": "num_prefixes",
        "zipf": "zipf",
        "turns": "turns",
        "think_time": "think_time",
    },
    "few-shot": {
        "prefix_len": "instruction_len",
        "user_len": "query_len",
        "output_len": "output_len",
        "num_prefixes": "num_tasks",
        "zipf": "zipf",
        "shots": "max_shots",
        "example_len": "example_len",
    },
    "agent": {
        "prefix_len": "system_len",
        "user_len": "tool_len",
        "output_len": "output_len",
        "turns": "steps",
        "think_time": "tool_time",
    },
    "parallel": {"user_len": "prompt_len", "output_len": "output_len", "samples": "n"},
    "unique": {"user_len": "prompt_len", "output_len": "output_len"},
}
GENERATORS = {
    "shared-prefix": shared_prefix,
    "multi-turn": multi_turn,
    "few-shot": few_shot,
    "agent": agent,
    "parallel": parallel,
    "unique": lambda num_requests, **kw: parallel(num_requests, n=1, **kw),
}
LENGTH_OPTIONS = {"prefix_len", "user_len", "output_len", "turns", "example_len"}


def build_workload(
    kind: str,
    num_requests: int,
    rate: float,
    arrival: str,
    cv: float,
    seed: int,
    options: dict[str, Any],
) -> Workload:
    """The generator `kind` with CLI options mapped onto its keywords (None means its default)."""
    check_numbers(rate, cv, options)
    if kind == "default":
        given = [k for k, v in options.items() if v is not None]
        if given:
            raise ValueError(
                f"kind 'default' takes no shape options (got --{given[0].replace('_', '-')})"
            )
        return default_workload(seed)
    keywords = OPTION_KEYWORDS[kind]
    kwargs: dict[str, Any] = {}
    for opt, value in options.items():
        if value is None:
            continue
        if opt not in keywords:
            raise ValueError(f"kind {kind!r} does not take --{opt.replace('_', '-')}")
        kwargs[keywords[opt]] = parse_lengths(value) if opt in LENGTH_OPTIONS else value
    return GENERATORS[kind](
        num_requests, arrivals=make_arrivals(arrival, rate, cv), seed=seed, **kwargs
    )


def check_numbers(rate: float, cv: float, options: dict[str, Any]) -> None:
    """Reject NaN, infinite and negative numbers (and a zero rate) before anything is generated."""
    given = {"rate": rate, "cv": cv, **{k: options.get(k) for k in ("zipf", "think_time")}}
    for name, v in given.items():
        low = "> 0" if name == "rate" else ">= 0"
        if v is None:
            continue
        if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0
                or (name == "rate" and v == 0)):
            raise ValueError(f"{name} must be a finite number {low}, got {v!r}")
    for name in ("num_prefixes", "samples", "shots"):
        v = options.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
