"""benchmarks/gpu_benches.py's bookkeeping with a fake timer: which figures each point records, their
exact values from given times, their targets, and null figures (with the reason) for a side that CUDA
graphs could not time. The kernels run for real (on CPU under Triton's interpreter without CUDA)."""

import sys
from pathlib import Path

import pytest
import torch
from gpu_env import DEVICE

from kvsim.gpu.timing import GraphTiming

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from gpu_benches import Figures, Plan, bench_decode, bench_write_kv  # noqa: E402

US8 = 2.0**-17  # ~7.6 us: times that are binary fractions keep the ratios exact


class FakeBench:
    """Seconds per call of each measured function, by its name; graph timings likewise."""

    def __init__(self, eager: dict[str, float], graph: dict[str, GraphTiming]):
        self.dev, self.eager, self.graph_times = torch.device(DEVICE), eager, graph
        self.graph_asked: list[tuple[str, float]] = []

    def __call__(self, fn) -> float:
        return self.eager[fn.__name__]

    def graph(self, fn, eager_seconds: float) -> GraphTiming:
        self.graph_asked.append((fn.__name__, eager_seconds))
        return self.graph_times[fn.__name__]


def _plan(cuda_graph: bool) -> Plan:
    return Plan(1, 4, 2, 32, None, 2, (16,), (2,), (64,), 64, 2, 0.0, cuda_graph=cuda_graph)


def test_write_kv_graph_figures_from_fake_times():
    bench = FakeBench({"index_copy": 20e-6, "index_put": 30e-6, "ours": 40e-6},
                      {"index_copy": GraphTiming(0.9375 * US8), "ours": GraphTiming(US8)})
    fig = Figures()
    out = bench_write_kv(bench, fig, _plan(True), 16, torch.float16)
    assert bench.graph_asked == [("ours", 40e-6), ("index_copy", 20e-6)]
    assert sorted(fig.rows) == ["write_kv_t16.fraction_of_index_copy", "write_kv_t16.fraction_of_index_copy_graph",
                                "write_kv_t16.fraction_of_index_put", "write_kv_t16.matches_torch"]
    assert fig.rows["write_kv_t16.fraction_of_index_copy"]["value"] == 0.5  # eager: unchanged
    assert fig.rows["write_kv_t16.fraction_of_index_copy"]["pass"] is False
    row = fig.rows["write_kv_t16.fraction_of_index_copy_graph"]
    assert (row["value"], row["target"], row["compare"], row["pass"]) == (0.9375, 0.9, ">=", True)
    assert out["write_kv_t16"]["graph"] == {"seconds": US8, "index_copy_seconds": 0.9375 * US8,
                                            "fraction_of_index_copy": 0.9375, "reason": None}
    assert fig.not_measured() == {}


def test_write_kv_without_graphs_records_no_graph_figure():
    bench = FakeBench({"index_copy": 20e-6, "index_put": 30e-6, "ours": 40e-6}, {})
    fig = Figures()
    out = bench_write_kv(bench, fig, _plan(False), 16, torch.float16)
    assert bench.graph_asked == [] and "graph" not in out["write_kv_t16"]
    assert not any(n.endswith("_graph") for n in fig.rows)


def test_decode_graph_figures_null_when_a_side_fails_to_capture():
    bench = FakeBench({"ours": 80e-6, "sdpa": 40e-6},
                      {"ours": GraphTiming(8e-6), "sdpa": GraphTiming(None, "CUDA graph capture failed: X")})
    fig = Figures()
    out = bench_decode(bench, fig, _plan(True), 16, torch.float16, 1e12, 64)
    assert fig.rows["decode_b2_c64.sdpa_ratio"]["value"] == 2.0  # eager: unchanged
    ratio = fig.rows["decode_b2_c64.sdpa_ratio_graph"]
    assert ratio == {"value": None, "unit": "x", "target": 1.25, "compare": "<=", "pass": None,
                     "what": "the same, both replayed from CUDA graphs",
                     "reason": "baseline: CUDA graph capture failed: X"}
    # the kernel's own graph time still gives its HBM fraction: 2 (K, V) x 2 seqs x 64 tokens x 2 heads x 32 dims x 2 bytes
    hbm = fig.rows["decode_b2_c64.hbm_fraction_graph"]
    assert hbm["value"] == pytest.approx(2 * 2 * 64 * 2 * 32 * 2 / 8e-6 / 1e12, rel=1e-12)
    assert (hbm["target"], hbm["pass"]) == (0.7, False)
    assert fig.not_measured() == {"decode_b2_c64.sdpa_ratio_graph": "baseline: CUDA graph capture failed: X"}
    assert out["decode_b2_c64"]["graph"]["sdpa_seconds"] is None and out["decode_b2_c64"]["graph"]["seconds"] == 8e-6


def test_decode_graph_ratio_meets_the_target_at_batch_2():
    bench = FakeBench({"ours": 80e-6, "sdpa": 40e-6}, {"ours": GraphTiming(1.125 * US8), "sdpa": GraphTiming(US8)})
    fig = Figures()
    bench_decode(bench, fig, _plan(True), 16, torch.float16, 1e12, 64)
    row = fig.rows["decode_b2_c64.sdpa_ratio_graph"]
    assert (row["value"], row["pass"]) == (1.125, True) and "reason" not in row
