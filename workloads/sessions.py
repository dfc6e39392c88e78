"""Session shapes: multi-turn chat and agent loops, whose prompts grow turn by turn.

Turn i's prompt is turn i-1's prompt + its answer (`output`, known token ids)
+ a new message; `think_time` is the pause before turn i (i >= 1) and its
arrival is the previous turn's arrival + think_time (a closed-loop simulator
re-places it after the previous answer). Sessions start at the arrival
process's times (so `rate` counts sessions) and turns are streamed in
arrival order, holding only the sessions in progress.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from kvsim.workloads.arrivals import ArrivalProcess, Poisson
from kvsim.workloads.lengths import Fixed, Lengths, LogNormal, Uniform
from kvsim.workloads.request import Request, Workload, make_request
from kvsim.workloads.shapes import ALL_TOKENS, OUTPUT_LEN, streams, zipf_weights
from kvsim.workloads.tokens import TokenCounter

CHAT_TURNS = Uniform(2, 8)
CHAT_SYSTEM_LEN = Fixed(256)
CHAT_USER_LEN = LogNormal(64, 1.0)
CHAT_SESSIONS = Poisson(0.2)
AGENT_STEPS = Uniform(4, 16)
AGENT_SYSTEM_LEN = Fixed(2048)
TASK_LEN = LogNormal(256, 0.5)
TOOL_LEN = LogNormal(384, 1.0)
CALL_LEN = LogNormal(48, 0.5)
AGENT_SESSIONS = Poisson(0.1)


@dataclass(frozen=True)
class SessionShape:
    """What one session looks like: its prefix, messages, answers, length and pauses."""

    tag: str
    turns: Lengths
    system_len: Lengths
    first_len: Lengths
    message_len: Lengths
    output_len: Lengths
    think_time: float
    num_prefixes: int = 1
    zipf: float = 1.0


def _session(
    shape: SessionShape,
    index: int,
    start: float,
    prefixes: list[np.ndarray],
    rng: np.random.Generator,
    tokens: TokenCounter,
) -> list[Request]:
    sid = f"{shape.tag}-{index}"
    k = int(rng.choice(len(prefixes), p=zipf_weights(len(prefixes), shape.zipf)))
    n = max(1, int(shape.turns.sample(1, rng)[0]))
    msgs = np.concatenate([shape.first_len.sample(1, rng), shape.message_len.sample(n - 1, rng)])
    outs = shape.output_len.sample(n, rng)
    thinks = (
        rng.exponential(shape.think_time, size=n - 1) if shape.think_time > 0 else np.zeros(n - 1)
    )
    context, t, turns = prefixes[k], start, []
    for i in range(n):
        think = None if i == 0 else float(thinks[i - 1])
        t = start if think is None else t + think
        prompt = np.concatenate([context, tokens.take(int(msgs[i]))])
        output = tokens.take(int(outs[i]))
        turns.append(
            make_request(
                f"{sid}-{i}", t, prompt, len(output), output=output, session=sid, think_time=think
            )
        )
        context = np.concatenate([prompt, output])
    return turns


def session_workload(
    shape: SessionShape,
    num_requests: int,
    arrivals: ArrivalProcess,
    seed: int,
    token_range: tuple[int, int],
    name: str,
) -> Workload:
    """Exactly `num_requests` turns of `shape` sessions, in arrival order (last sessions may be cut)."""

    def source() -> Iterator[Request]:
        arr_rng, rng = streams(seed)
        starts = arrivals.times(num_requests, arr_rng)  # at most one session per request
        tokens = TokenCounter(*token_range)
        prefixes = [tokens.take(int(m)) for m in shape.system_len.sample(shape.num_prefixes, rng)]
        pending: list[tuple[float, int, Request]] = []
        opened = seq = emitted = 0
        while emitted < num_requests:
            while opened < len(starts) and (not pending or starts[opened] <= pending[0][0]):
                for r in _session(shape, opened, float(starts[opened]), prefixes, rng, tokens):
                    heapq.heappush(pending, (r.arrival, seq, r))
                    seq += 1
                opened += 1
            if not pending:
                return
            yield heapq.heappop(pending)[2]
            emitted += 1

    return Workload(source, name)


def multi_turn(
    num_requests: int,
    *,
    turns: Lengths = CHAT_TURNS,
    system_len: Lengths = CHAT_SYSTEM_LEN,
    num_prefixes: int = 1,
    zipf: float = 1.0,
    user_len: Lengths = CHAT_USER_LEN,
    output_len: Lengths = OUTPUT_LEN,
    think_time: float = 10.0,
    arrivals: ArrivalProcess = CHAT_SESSIONS,
    seed: int = 0,
    token_range: tuple[int, int] = ALL_TOKENS,
) -> Workload:
    """Chat sessions: system prompt, then user message / answer turns; mean `think_time` s pauses."""
    shape = SessionShape(
        "mt", turns, system_len, user_len, user_len, output_len, think_time, num_prefixes, zipf
    )
    return session_workload(shape, num_requests, arrivals, seed, token_range, "multi-turn")


def agent(
    num_requests: int,
    *,
    steps: Lengths = AGENT_STEPS,
    system_len: Lengths = AGENT_SYSTEM_LEN,
    task_len: Lengths = TASK_LEN,
    tool_len: Lengths = TOOL_LEN,
    output_len: Lengths = CALL_LEN,
    tool_time: float = 1.0,
    arrivals: ArrivalProcess = AGENT_SESSIONS,
    seed: int = 0,
    token_range: tuple[int, int] = ALL_TOKENS,
) -> Workload:
    """Agent loops: long tool-laden system prompt, a task, then short calls and tool results."""
    shape = SessionShape("ag", steps, system_len, task_len, tool_len, output_len, tool_time)
    return session_workload(shape, num_requests, arrivals, seed, token_range, "agent")
