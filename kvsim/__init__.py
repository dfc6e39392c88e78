"""kvsim: simulate paged KV-cache block management as vLLM 0.33 runs it, and replay it on GPUs.

    import kvsim
    run = kvsim.simulate(num_gpu_blocks=512, eviction="s3fifo")   # the embedded default workload
    run.summary["hit_rate"], run.requests, run.steps                # a dict and two DataFrames
    wl = kvsim.load_workload("trace.jsonl")                         # or generate_workload("multi-turn", ...)
    kvsim.curve(wl, capacities=[256, 512, 1024], policies=["lru", "arc"])

The calls and their keywords are documented in `kvsim.sim.api` (and the README's "Python API");
they are the stable surface. The source folders install beneath this package as `kvsim.sim`,
`kvsim.kvcache`, `kvsim.gpu` and `kvsim.workloads`.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version
from typing import Any

# NOTE: the names load on first use (`kvsim.sim.api`), so `kvsim --help`, which imports this
# package on its way to `kvsim.sim.cli`, pulls in no numpy, pandas or simpy.
__all__ = [
    "ConfigError", "Run", "SimConfig", "Workload", "WorkloadError", "cache_replay", "capacity", "config", "conform",
    "curve", "default_workload", "generate_workload", "load_workload", "simulate", "simulate_cluster", "simulate_pd", "sweep",
    "workload_stats",
]  # fmt: skip
try:
    __version__ = _version("kvsim")
except PackageNotFoundError:  # (run from a checkout that was never installed)
    __version__ = "0+unknown"


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'kvsim' has no attribute {name!r}")
    from kvsim.sim import api

    return getattr(api, name)


def __dir__() -> list[str]:
    return sorted([*__all__, "__version__"])
