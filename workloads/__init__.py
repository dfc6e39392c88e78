"""Workloads: the request model, synthetic generators and trace loaders.

The names below load on first use, so importing one light module (say
`workloads.errors`) does not pull numpy and every loader in with it.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "Request": "kvsim.workloads.request",
    "Workload": "kvsim.workloads.request",
    "iter_chunks": "kvsim.workloads.request",
    "make_request": "kvsim.workloads.request",
    "WorkloadError": "kvsim.workloads.errors",
    "default_workload": "kvsim.workloads.default",
    "describe": "kvsim.workloads.stats",
    "ideal_hit_rate": "kvsim.workloads.stats",
    "detect_format": "kvsim.workloads.traces",
    "load_workload": "kvsim.workloads.traces",
    "write_jsonl": "kvsim.workloads.jsonl",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'workloads' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
