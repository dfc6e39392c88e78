"""Workloads: the request model, synthetic generators and trace loaders."""

from workloads.request import Request, Workload, make_request

__all__ = ["Request", "Workload", "make_request"]
