"""Kernel time per (step, kind): CUDA events on a GPU, read once at the end; perf_counter on CPU.

A replay launches its kernels from Python, often slower than the GPU runs them, and events
around such a region would time the host. So each region starts with a spin kernel a little
longer than the host took to enqueue that kind's last region: the GPU reaches the start event
only once the region's kernels are queued, and the events time the kernels alone.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class Timer:
    """Accumulates the time of the code run under `timer(step, kind)`."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._events: list[tuple[int, str, torch.cuda.Event, torch.cuda.Event]] = []
        self._totals: defaultdict[tuple[int, str], float] = defaultdict(float)
        self.calls: defaultdict[tuple[int, str], int] = defaultdict(int)  # timed regions per (step, kind)
        self._enqueue_s: dict[str, float] = {}  # host seconds the last region of each kind took
        # SM clock (kHz in the properties, where torch has it) for the spin's cycle count
        self._hz = getattr(torch.cuda.get_device_properties(device), "clock_rate", 1_980_000) * 1e3 if self.cuda else 0.0

    @contextmanager
    def __call__(self, step: int, kind: str) -> Iterator[None]:
        self.calls[(step, kind)] += 1
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(int(self._hz * (1.5 * self._enqueue_s.get(kind, 1e-3) + 20e-6)))
            start.record()
            t0 = time.perf_counter()
            yield
            self._enqueue_s[kind] = time.perf_counter() - t0
            end.record()
            self._events.append((step, kind, start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._totals[(step, kind)] += time.perf_counter() - t0

    def totals(self) -> dict[tuple[int, str], float]:
        """Seconds per (step, kind) so far (synchronises the device once)."""
        if self._events:
            torch.cuda.synchronize()
            for step, kind, start, end in self._events:
                self._totals[(step, kind)] += start.elapsed_time(end) / 1e3
            self._events.clear()
        return dict(self._totals)


def time_call(fn, device: torch.device, *, warmup: int = 3, iters: int = 20) -> float:
    """Mean seconds per call of `fn()` after `warmup` calls (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters
