"""Workloads: the request model, synthetic generators and trace loaders."""

from workloads.default import default_workload
from workloads.errors import WorkloadError
from workloads.jsonl import write_jsonl
from workloads.request import Request, Workload, iter_chunks, make_request
from workloads.stats import describe, ideal_hit_rate
from workloads.traces import detect_format, load_workload

__all__ = [
    "Request",
    "Workload",
    "WorkloadError",
    "default_workload",
    "describe",
    "detect_format",
    "ideal_hit_rate",
    "iter_chunks",
    "load_workload",
    "make_request",
    "write_jsonl",
]
