"""Synthetic workload shapes: shared system prompts, few-shot, parallel sampling.

Every generator returns a re-iterable Workload: each pass re-seeds a numpy
Generator from `seed`, so the same seed gives the same requests. Text that
is shared (a system prompt, a few-shot example) is the same token ids; every
other piece of text gets fresh ids from a counter over `token_range`, so two
generators merged together must be given disjoint ranges. Session shapes
(multi-turn chat, agent loops) live in `workloads/sessions.py`.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

import numpy as np

from kvsim.workloads.arrivals import ArrivalProcess, Poisson
from kvsim.workloads.lengths import Fixed, Lengths, LogNormal, Uniform
from kvsim.workloads.request import Request, Workload, make_request
from kvsim.workloads.tokens import INT32_MAX, TokenCounter

ALL_TOKENS = (0, INT32_MAX + 1)
ONE_PER_SECOND = Poisson(1.0)
SYSTEM_PROMPT_LEN = Fixed(1024)
USER_LEN = LogNormal(128, 1.0)
OUTPUT_LEN = LogNormal(256, 1.0)
INSTRUCTION_LEN = Fixed(64)
EXAMPLE_LEN = Uniform(100, 300)
QUERY_LEN = LogNormal(64, 0.5)
SHORT_OUTPUT_LEN = LogNormal(64, 0.5)
PROMPT_LEN = LogNormal(512, 1.0)


def zipf_weights(k: int, s: float) -> np.ndarray:
    """Popularity of items 0..k-1 proportional to 1/(rank+1)**s (s = 0 is uniform)."""
    if k < 1:
        raise ValueError(f"need at least one item, got {k}")
    w = 1.0 / np.arange(1, k + 1, dtype=np.float64) ** s
    return w / w.sum()


def streams(seed: int) -> tuple[np.random.Generator, np.random.Generator]:
    """Independent (arrival, content) generators from one seed, so knobs don't shift each other."""
    a, c = np.random.default_rng(seed).spawn(2)
    return a, c


def shared_prefix(
    num_requests: int,
    *,
    num_prefixes: int = 8,
    zipf: float = 1.0,
    prefix_len: Lengths = SYSTEM_PROMPT_LEN,
    user_len: Lengths = USER_LEN,
    output_len: Lengths = OUTPUT_LEN,
    arrivals: ArrivalProcess = ONE_PER_SECOND,
    seed: int = 0,
    token_range: tuple[int, int] = ALL_TOKENS,
) -> Workload:
    """Requests whose prompt is one of K system prompts (Zipf popularity) + a unique message."""

    def source() -> Iterator[Request]:
        arr_rng, rng = streams(seed)
        times = arrivals.times(num_requests, arr_rng)
        tokens = TokenCounter(*token_range)
        prefixes = [tokens.take(int(n)) for n in prefix_len.sample(num_prefixes, rng)]
        pick = rng.choice(num_prefixes, size=num_requests, p=zipf_weights(num_prefixes, zipf))
        users = user_len.sample(num_requests, rng)
        outs = output_len.sample(num_requests, rng)
        for i in range(num_requests):
            prompt = np.concatenate([prefixes[pick[i]], tokens.take(int(users[i]))])
            yield make_request(f"sp-{i}", times[i], prompt, int(outs[i]))

    return Workload(source, "shared-prefix")


def few_shot(
    num_requests: int,
    *,
    num_tasks: int = 4,
    zipf: float = 1.0,
    max_shots: int = 8,
    instruction_len: Lengths = INSTRUCTION_LEN,
    example_len: Lengths = EXAMPLE_LEN,
    query_len: Lengths = QUERY_LEN,
    output_len: Lengths = SHORT_OUTPUT_LEN,
    arrivals: ArrivalProcess = ONE_PER_SECOND,
    seed: int = 0,
    token_range: tuple[int, int] = ALL_TOKENS,
) -> Workload:
    """Few-shot templates: a shared instruction, then the first k examples of a task, then a query.

    The task has Zipf popularity and k is uniform in 1..max_shots, so
    templates of one task share prefixes of different depths.
    """

    def source() -> Iterator[Request]:
        arr_rng, rng = streams(seed)
        times = arrivals.times(num_requests, arr_rng)
        tokens = TokenCounter(*token_range)
        instruction = tokens.take(int(instruction_len.sample(1, rng)[0]))
        examples = [
            [tokens.take(int(n)) for n in example_len.sample(max_shots, rng)]
            for _ in range(num_tasks)
        ]
        task = rng.choice(num_tasks, size=num_requests, p=zipf_weights(num_tasks, zipf))
        shots = rng.integers(1, max_shots + 1, size=num_requests)
        queries = query_len.sample(num_requests, rng)
        outs = output_len.sample(num_requests, rng)
        for i in range(num_requests):
            parts = [instruction, *examples[task[i]][: shots[i]], tokens.take(int(queries[i]))]
            yield make_request(f"fs-{i}", times[i], np.concatenate(parts), int(outs[i]))

    return Workload(source, "few-shot")


def parallel(
    num_requests: int,
    *,
    n: int = 4,
    prompt_len: Lengths = PROMPT_LEN,
    output_len: Lengths = OUTPUT_LEN,
    arrivals: ArrivalProcess = ONE_PER_SECOND,
    seed: int = 0,
    token_range: tuple[int, int] = ALL_TOKENS,
) -> Workload:
    """Unique prompts, each asking for `n` parallel samples (n = 1: plain unique requests)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")

    def source() -> Iterator[Request]:
        arr_rng, rng = streams(seed)
        times = arrivals.times(num_requests, arr_rng)
        tokens = TokenCounter(*token_range)
        prompts = prompt_len.sample(num_requests, rng)
        outs = output_len.sample(num_requests, rng)
        for i in range(num_requests):
            yield make_request(
                f"par-{i}", times[i], tokens.take(int(prompts[i])), int(outs[i]), n=n
            )

    return Workload(source, "parallel" if n > 1 else "unique")


def merge(*workloads: Workload, name: str = "mix") -> Workload:
    """Interleave workloads by arrival (ties: argument order). Ids and token ranges must not clash."""
    return Workload(
        lambda: heapq.merge(*(iter(w) for w in workloads), key=lambda r: r.arrival), name
    )
