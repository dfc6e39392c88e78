"""Workloads: the request model, synthetic generators and trace loaders.

The names below load on first use, so importing one light module (say
`workloads.errors`) does not pull numpy and every loader in with it.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "Request": "workloads.request",
    "Workload": "workloads.request",
    "iter_chunks": "workloads.request",
    "make_request": "workloads.request",
    "WorkloadError": "workloads.errors",
    "default_workload": "workloads.default",
    "describe": "workloads.stats",
    "ideal_hit_rate": "workloads.stats",
    "detect_format": "workloads.traces",
    "load_workload": "workloads.traces",
    "write_jsonl": "workloads.jsonl",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'workloads' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
