"""The embedded default workload: small, fast to simulate, with prefix sharing of both kinds."""

from __future__ import annotations

from kvsim.workloads.arrivals import Poisson
from kvsim.workloads.lengths import Fixed, LogNormal, Uniform
from kvsim.workloads.request import Workload
from kvsim.workloads.sessions import multi_turn
from kvsim.workloads.shapes import merge, shared_prefix

DEFAULT_SEED = 0


def default_workload(seed: int = DEFAULT_SEED) -> Workload:
    """300 requests over about a minute: 4 shared system prompts (Zipf) mixed with chat sessions.

    Used by `kvsim workload stats` and `kvsim run` when no workload is given.
    """
    prompts = shared_prefix(
        150,
        num_prefixes=4,
        prefix_len=Fixed(512),
        user_len=LogNormal(96, 1.0, hi=1024),
        output_len=LogNormal(128, 1.0, hi=512),
        arrivals=Poisson(2.5),
        seed=seed,
        token_range=(0, 2**29),
    )
    chats = multi_turn(
        150,
        turns=Uniform(2, 6),
        system_len=Fixed(128),
        user_len=LogNormal(64, 1.0, hi=512),
        output_len=LogNormal(128, 1.0, hi=512),
        think_time=5.0,
        arrivals=Poisson(0.6),
        seed=seed + 1,
        token_range=(2**29, 2**30),
    )
    return merge(prompts, chats, name="default")
