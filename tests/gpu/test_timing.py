"""gpu.timing's CUDA-graph timing: None with the reason where there is no graph to replay, seconds where
there is (those tests need CUDA and skip without it)."""

import pytest
import torch

from kvsim.gpu.timing import GraphTiming, capture_graph, time_graph


def test_time_graph_without_cuda_says_why():
    calls = []
    assert time_graph(lambda: calls.append(1), torch.device("cpu"), calls=10) == GraphTiming(
        None, "no CUDA graphs on device cpu")
    assert calls == []  # nothing ran


@pytest.mark.cuda
def test_a_captured_graph_replays_every_call():
    x = torch.zeros(4, device="cuda")
    graph = capture_graph(lambda: x.add_(1), calls=3, warmup=2)
    torch.cuda.synchronize()
    assert x.tolist() == [2.0] * 4  # the warm-up ran eagerly; the capture did not run
    graph.replay()
    torch.cuda.synchronize()
    assert x.tolist() == [5.0] * 4


@pytest.mark.cuda
def test_time_graph_times_a_capturable_call_and_names_a_failed_capture():
    x = torch.zeros(1 << 20, device="cuda")
    timing = time_graph(lambda: x.add_(1), torch.device("cuda"), calls=4, iters=3)
    assert timing.reason is None and timing.seconds > 0
    failed = time_graph(lambda: x.sum().item(), torch.device("cuda"), calls=2)  # a host sync: no capture
    assert failed.seconds is None and failed.reason.startswith("CUDA graph capture failed: ")
    assert float(x[0]) >= 2 + 4 * 4  # warm-ups and replays ran; and the device still works after the failure
