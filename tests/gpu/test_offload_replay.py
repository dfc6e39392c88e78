"""KV offloading's `store` and `load` ops replayed on paged storage with a host tier: every token a
load brings back is verified when its request next computes (`gpu.replay`, `gpu.executor`)."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_env import DEVICE
from gpu_scenarios import save_run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsim.gpu.backends import BACKENDS
from kvsim.gpu.replay import load_run, replay_ops, replay_run
from kvsim.kvcache.ops import Op
from kvsim.sim.engine.config import SimConfig
from kvsim.sim.engine.run import simulate
from kvsim.workloads.build import build_workload
from kvsim.workloads.request import Workload
from tests.sim.engine.engine_fixtures import req
from tests.sim.engine.test_offload import MIB, HostLinkCost, _evicted_prefix


def _record(tmp_path, requests, link_s: float = 0.0, chunks: int = 16, **cfg):
    """Simulate `requests` with a tier of `chunks` 1 MiB chunks and the ops recorded; the run folder.
    Sync scheduling: the steps below are tests/sim/engine/test_offload.py's, worked out for vLLM's `Scheduler`."""
    c = SimConfig(**{"block_size": 4, "num_gpu_blocks": 8, "kv_offloading_size": chunks * MIB / (1 << 30),
                     "record_ops": True, "async_scheduling": False, **cfg})
    res = simulate(Workload.from_list(requests, "test"), c, cost_model=HostLinkCost(link_s))
    return save_run(res.manager, tmp_path)


def _transfers(run) -> list[tuple]:
    ops, _, _ = load_run(run, rows=True)
    return [(step, kind, a, b, seq) for step, kind, a, b, _, seq, *_ in ops if kind in ("store", "load")]


@pytest.mark.parametrize("kernels", BACKENDS)
def test_a_prefix_loaded_back_from_the_tier_replays_clean(tmp_path, kernels) -> None:
    """tests/sim/engine/test_offload.py's evicted prefix: a's 4 prompt blocks go to host blocks 0-3,
    f's 6 to 4-9, and b loads host blocks 0-3 into GPU blocks 1-4 (a `load`'s a is the host block)."""
    run = _record(tmp_path, _evicted_prefix())
    assert _transfers(run) == [
        *((0, "store", g, h, "a") for g, h in ((1, 0), (2, 1), (3, 2), (4, 3))),
        *((2, "store", g, h, "f") for g, h in ((5, 4), (6, 5), (7, 6), (4, 7), (3, 8), (2, 9))),
        *((4, "load", h, g, "b") for h, g in ((0, 1), (1, 2), (2, 3), (3, 4))),
        (4, "store", 7, 10, "b"),
    ]
    rep = replay_run(run, DEVICE, kernels=kernels, attention_layers=2)
    assert rep.ok and (rep.ops["store"], rep.ops["load"]) == (11, 4)
    assert rep.geometry["host_blocks"] == 11 and rep.tokens_verified == 123


def _finished_store_flushed():
    """x fills the 4-chunk tier with stores that land at t=7 (4 blocks at 1.25 s, from t=1, when the step
    after the one planning them starts); a's own offers fail until then. a finishes
    at t=7; at step 7 f takes every free GPU block, a's included, and its 8-chunk offer fails, so a's
    retried 2-chunk offer (vLLM offers a finished request's chunks at the next step) is stored from
    blocks f is about to overwrite: the worker copies them before the forward (`jobs_to_flush`). b
    then loads a's prompt back."""
    p = np.arange(100, 108)
    return [req("x", 0, 16, 10), req("a", 0, p, 7), req("f", 7, 34, 2),
            req("b", 20, np.concatenate([p, np.arange(600, 604)]), 2)]


def test_a_finished_request_s_store_is_recorded_ahead_of_the_step_that_reuses_its_blocks(tmp_path) -> None:
    run = _record(tmp_path, _finished_store_flushed(), link_s=1.25, chunks=4, num_gpu_blocks=16)
    assert _transfers(run) == [
        *((0, "store", g, h, "x") for g, h in ((1, 0), (2, 1), (3, 2), (4, 3))),
        (7, "store", 5, 2, "a"), (7, "store", 6, 3, "a"),
        (10, "load", 2, 5, "b"), (10, "load", 3, 6, "b"), (10, "store", 8, 1, "b"),
    ]
    ops, tokens, config = load_run(run, rows=True)
    first7 = next(i for i, op in enumerate(ops) if op[0] == 7)
    assert ops[first7][1] == "store" and ops[first7][5] == "a"  # before f's evicts, table entries and writes
    assert replay_ops(ops, tokens, config, DEVICE).ok
    # recorded where vLLM decides it (after f's writes of step 7), the store would copy f's K/V
    stores = [op for op in ops if op[1] == "store" and op[5] == "a"]
    rest = [op for op in ops if op not in stores]
    last7 = max(i for i, op in enumerate(rest) if op[0] == 7)
    late = rest[:last7 + 1] + stores + rest[last7 + 1:]
    assert replay_ops(late, tokens, config, DEVICE, strict=False).mismatches == 12


@pytest.mark.parametrize("fault", ["store dropped", "load from the wrong host block"])
def test_a_wrong_transfer_is_caught(tmp_path, fault) -> None:
    ops, tokens, config = load_run(_record(tmp_path, _evicted_prefix()))
    if fault == "store dropped":
        i = next(i for i, op in enumerate(ops) if op.kind == "store" and op.seq == "a")
        ops = ops[:i] + ops[i + 1:]
    else:
        i = next(i for i, op in enumerate(ops) if op.kind == "load")
        op = ops[i]
        ops[i] = Op(op.step, op.kind, op.a + 1, op.b, op.c, op.seq, op.hash, op.pos)
    assert replay_ops(ops, tokens, config, DEVICE, strict=False).mismatches == 8


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), kind=st.sampled_from(["shared-prefix", "multi-turn"]),
       link_s=st.sampled_from([0.0, 0.05, 0.5]), gpu_blocks=st.integers(30, 120), chunks=st.integers(4, 40),
       prompt_only=st.booleans(), bpc=st.integers(1, 2), cap=st.sampled_from([0, 16]))
def test_random_offloading_runs_replay_clean(tmp_path_factory, seed, kind, link_s, gpu_blocks, chunks, prompt_only,
                                             bpc, cap) -> None:
    """Stores, loads, flushes and failed stores of random runs: every token verified, 0 mismatches."""
    shape = {"output_len": "uniform:2,30", "user_len": "uniform:4,40"}
    if kind == "shared-prefix":
        shape["prefix_len"] = "uniform:8,40"
    wl = build_workload(kind, 25, 4.0, "poisson", 1.0, seed, shape)
    run = _record(tmp_path_factory.mktemp("run"), list(wl), link_s, chunks, num_gpu_blocks=gpu_blocks,
                  offload_prompt_only=prompt_only, offload_blocks_per_chunk=bpc, max_num_batched_tokens=64,
                  max_num_seqs=8, long_prefill_token_threshold=cap)
    rep = replay_run(run, DEVICE, kernels="torch", strict=False)
    assert rep.mismatches == 0, rep.errors[:3]


def test_file_tier_transfers_replay_against_files(tmp_path) -> None:
    """tests/sim/engine/test_offload_fs.py's run: a's 4 chunks are written to files once stored
    (`file_write`, host block -> file block), evicted from the host by f's, and read back into
    host slots (`file_read`) before b loads them: each a block, recorded as the file job is
    applied; the replay keeps the file tier's blocks in files."""
    from tests.sim.engine.test_offload_fs import FS

    run = _record(tmp_path, _evicted_prefix(), chunks=6, **FS)
    ops, tokens, config = load_run(run)
    moves = [(op.kind, op.a, op.b, op.seq) for op in ops if op.kind.startswith("file_")]
    assert moves[:4] == [("file_write", h, h, "a") for h in range(4)]
    # promoted into the slots f's evicted chunks left, last freed first
    assert [m for m in moves if m[0] == "file_read"] == [("file_read", f, h, "b") for f, h in
                                                         zip(range(4), (3, 2, 1, 0), strict=True)]
    assert replay_ops(ops, tokens, config, DEVICE).ok
    i = next(i for i, op in enumerate(ops) if op.kind == "file_write" and op.seq == "a")
    assert replay_ops(ops[:i] + ops[i + 1:], tokens, config, DEVICE, strict=False).mismatches == 8
