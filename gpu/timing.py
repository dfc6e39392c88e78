"""Kernel time per (step, kind): CUDA events on a GPU, read once at the end; perf_counter on CPU.
Also the mean time of a call (`time_call`) and of a call replayed from a CUDA graph (`time_graph`).

A replay launches its kernels from Python, often slower than the GPU runs them, and events
around such a region would time the host. So each region starts with a spin kernel a little
longer than the host took to enqueue that kind's last region: the GPU reaches the start event
only once the region's kernels are queued, and the events time the kernels alone.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch


class Timer:
    """Accumulates the time of the code run under `timer(step, kind)`."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._events: list[tuple[int, str, torch.cuda.Event, torch.cuda.Event]] = []
        self._totals: defaultdict[tuple[int, str], float] = defaultdict(float)
        self.calls: defaultdict[tuple[int, str], int] = defaultdict(int)  # timed regions per (step, kind)
        self.launches: defaultdict[tuple[int, str], int] = defaultdict(int)  # kernels per (step, kind)
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

    def launched(self, step: int, kind: str, kernels: int) -> int:
        """Count `kernels` launches of `kind` in `step` (a per-launch cost is fitted to them); returns it."""
        self.launches[(step, kind)] += kernels
        return kernels

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


class GraphTiming(NamedTuple):
    """`time_graph`'s answer: seconds per call, or None and the reason it could not be timed."""

    seconds: float | None
    reason: str | None = None


def capture_graph(fn: Callable[[], object], calls: int = 1, warmup: int = 2) -> torch.cuda.CUDAGraph:
    """`calls` back-to-back calls of `fn` captured into one CUDA graph, after `warmup` eager calls on a
    side stream (torch's capture recipe: they compile Triton kernels and settle torch's workspaces
    outside the capture). Raises whatever the capture raises. `fn` must read and write tensors
    allocated before the call: a replay reuses the captured addresses."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def time_graph(fn: Callable[[], object], device: torch.device, *, calls: int = 1, warmup: int = 2,
               iters: int = 20) -> GraphTiming:
    """Mean seconds per call of `fn()` replayed from a CUDA graph of `calls` calls (`capture_graph`),
    timed over `iters` replays after `warmup`: the GPU's time without Python's launch path, as vLLM
    runs decode. GraphTiming(None, reason) without CUDA or when the capture fails; never raises."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return GraphTiming(None, f"no CUDA graphs on device {device}")
    try:
        graph = capture_graph(fn, calls)
    except Exception as e:  # noqa: BLE001 - any capture failure is reported, not raised
        try:
            torch.cuda.synchronize(device)
        except Exception:  # noqa: BLE001
            pass
        first_line = (str(e).strip().splitlines() or [""])[0]
        return GraphTiming(None, f"CUDA graph capture failed: {type(e).__name__}: {first_line}")
    seconds = time_call(graph.replay, device, warmup=warmup, iters=iters) / calls
    del graph
    return GraphTiming(seconds)
