"""Op records with the speed shortcuts on: the same ops, step by step, as visiting every sequence."""

from __future__ import annotations

from collections import Counter, defaultdict

import pandas as pd
import pytest

from kvsim.kvcache import ops as oplog
from kvsim.kvcache.manager import KVCacheManager
from kvsim.kvcache.ops import Op, read_ops, read_tokens
from kvsim.sim.engine.config import SimConfig
from kvsim.sim.engine.run import simulate
from kvsim.workloads.request import Workload
from kvsim.workloads.shapes import parallel, shared_prefix

_GPU_A = ("write", "copy", "swap_out", "free", "evict", "table", "move")
_GPU_B = ("copy", "swap_in", "move")


def _workload() -> Workload:
    """Shared prefixes and parallel sampling, arriving fast enough to preempt."""
    from kvsim.workloads.arrivals import Poisson
    from kvsim.workloads.lengths import Fixed, LogNormal
    from kvsim.workloads.shapes import merge

    a = shared_prefix(40, num_prefixes=3, prefix_len=Fixed(64), user_len=LogNormal(30, 1.0, hi=150),
                      output_len=LogNormal(50, 1.0, hi=200), arrivals=Poisson(8.0), seed=5,
                      token_range=(0, 2**20))
    b = parallel(10, n=3, prompt_len=LogNormal(60, 0.5, hi=200), output_len=LogNormal(40, 0.5, hi=150),
                 arrivals=Poisson(3.0), seed=6, token_range=(2**20, 2**21))
    return merge(a, b, name="mixed")


CASES = {
    "recompute": {},
    "swap": {"preemption": "swap", "num_cpu_blocks": 400},
    "defrag": {"defrag_threshold": 4, "watermark": 0.05},
    "defrag+swap": {"defrag_threshold": 2, "preemption": "swap", "num_cpu_blocks": 400, "block_size": 8},
    "no-prefix-caching": {"enable_prefix_caching": False},
    "no-chunking": {"enable_chunked_prefill": False, "max_num_batched_tokens": 320, "block_size": 8},
    "fixed-step": {"step_time": 0.05},
    # the async output's lazy decodes (`AsyncLazy`), recorded late into their steps' schedules
    "async": {"async_scheduling": True, "parallel_sampling": "fanout"},
    "async-no-prefix-caching": {"async_scheduling": True, "parallel_sampling": "fanout",
                                "enable_prefix_caching": False},
    "async-fixed-step": {"async_scheduling": True, "parallel_sampling": "fanout", "step_time": 0.05},
}


def _cfg(**kw) -> SimConfig:
    base = {"num_gpu_blocks": 40, "max_num_seqs": 32, "max_num_batched_tokens": 64, "record_ops": True,
            "parallel_sampling": "fork",  # v0-style samples: copy-on-write ops are recorded too
            "async_scheduling": False}  # the sync scheduler's lazy decodes (`LazyDecodes`), recorded late
    return SimConfig(**{**base, **kw})


def _blocks(op: Op) -> list[tuple[str, int]]:
    """The blocks an op touches: ("gpu", id) / ("cpu", id)."""
    out = []
    if op.kind in _GPU_A:
        out.append(("gpu", op.a))
    elif op.kind == "swap_in":
        out.append(("cpu", op.a))
    if op.kind in _GPU_B:
        out.append(("gpu", op.b))
    elif op.kind == "swap_out":
        out.append(("cpu", op.b))
    return out


def _per_block(ops: list[Op]) -> dict[tuple, list[Op]]:
    """Per (step, block): the ops touching it, in stream order (what a replay depends on)."""
    out: dict[tuple, list[Op]] = defaultdict(list)
    for op in ops:
        for blk in _blocks(op):
            out[(op.step, *blk)].append(op)
    return dict(out)


def _late_writes(monkeypatch: pytest.MonkeyPatch, manager_class: type, ends: list[int] | None = None) -> list[int]:
    """The runs of late writes `manager_class.record_decodes` is asked to record (their lengths);
    `ends` gets each run's end (its last position + 1)."""
    late: list[int] = []
    record = manager_class.record_decodes

    def counted(m, seq, pos, step, n):
        late.append(n)
        if ends is not None:
            ends.append(pos + n)
        record(m, seq, pos, step, n)

    monkeypatch.setattr(manager_class, "record_decodes", counted)
    return late


def same_stream(a: list[Op], b: list[Op]) -> None:
    """Two op streams a replay cannot tell apart: the same runs of one step in the same order (a
    replay's steps: `gpu.replay`), each with the same ops (as a multiset), every block seeing them
    in the same order. With the async output a step's ops come in two such runs, its schedule's and,
    after the next step's schedule, its output's: a late write belongs in the first."""
    assert _step_runs(a) == _step_runs(b)
    assert _per_block(a) == _per_block(b)


def _step_runs(ops: list[Op]) -> list[tuple[int, Counter]]:
    """The stream as maximal runs of one step: (step, its ops as a multiset), in order."""
    out: list[tuple[int, Counter]] = []
    for op in ops:
        if not out or out[-1][0] != op.step:
            out.append((op.step, Counter()))
        out[-1][1][op] += 1
    return out


@pytest.mark.parametrize("case", CASES)
def test_recording_with_shortcuts_gives_the_plain_ops(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """Every step has the same ops (as a multiset) and every block sees them in the same order,
    with lazy decodes recorded late; the tables are those of a run that records nothing."""
    ends: list[int] = []
    late = _late_writes(monkeypatch, KVCacheManager, ends)
    cfg = _cfg(**CASES[case])
    fast = simulate(_workload(), cfg)
    assert sum(late) > 100 and max(late) > 1  # lazy decodes ran and were recorded in bulk
    # a block of unique decoded tokens fills lazily, its last slot's write recorded late too
    # (LazyDecodes.fills), except with defrag, which keeps each cache in its step
    filled = sum(e % cfg.block_size == 0 for e in ends)
    assert (filled > 10) if cfg.defrag_threshold is None else filled == 0
    n_late = len(late)
    slow = simulate(_workload(), cfg.replace(shortcuts=False))
    plain = simulate(_workload(), cfg.replace(record_ops=False))
    assert len(late) == n_late  # nothing late without the shortcuts
    s = fast.summary
    assert s["preemptions"] > 0 and (s["cow_copies"] > 0) == (cfg.parallel_sampling == "fork")
    if "defrag_threshold" in cfg.to_dict() and cfg.defrag_threshold is not None:
        assert s["defrag_moves"] > 0
    for other in (slow, plain):
        pd.testing.assert_frame_equal(fast.steps, other.steps)
        pd.testing.assert_frame_equal(fast.requests, other.requests)
    assert fast.manager.ops.counts == slow.manager.ops.counts
    assert fast.manager.ops.counts - Counter(table=10**9) == plain.manager.ops.counts  # tables: only recorded
    a, b = fast.manager.ops.records(), slow.manager.ops.records()
    assert len(a) == len(b) == fast.manager.ops.counts.total()
    same_stream(a, b)
    assert fast.manager.ops.tokens.keys() == slow.manager.ops.tokens.keys()
    assert all((fast.manager.ops.tokens[k] == v).all() for k, v in slow.manager.ops.tokens.items())


@pytest.mark.parametrize("case", ["defrag+swap", "async"])
def test_streamed_records_equal_the_in_memory_ones(tmp_path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """Streamed in chunks of a few rows (cut at step boundaries, late writes held back; with the
    async output, at a schedule's mark) the files hold exactly the in-memory stream, in the same
    order; tokens keep each sequence's last."""
    cfg = _cfg(**CASES[case])
    whole = simulate(_workload(), cfg)
    monkeypatch.setattr(oplog, "CHUNK_ROWS", 7)
    monkeypatch.setattr(oplog, "TOKEN_CHUNK", 50)
    streamed = simulate(_workload(), cfg, ops_dir=tmp_path)
    assert streamed.manager.ops._done > 0  # chunks went out while it ran
    out = tmp_path / "run"
    out.mkdir()
    streamed.manager.save_ops(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    import pyarrow.parquet as pq

    assert pq.ParquetFile(out / "ops.parquet").metadata.num_row_groups > 10
    assert read_ops(out / "ops.parquet") == whole.manager.ops.records()
    tokens, expect = read_tokens(out / "op_tokens.parquet"), whole.manager.ops.tokens
    assert tokens.keys() == expect.keys()
    assert all((tokens[k] == v).all() for k, v in expect.items())
    with pytest.raises(ValueError, match="streams to"):
        streamed.manager.ops.records()


def _hybrid_workload() -> list:
    """A shared system prompt and prompts of five lengths: prefix hits, a window moving, preemption."""
    import numpy as np

    from kvsim.workloads.request import make_request

    rng = np.random.default_rng(3)
    system = rng.integers(0, 1000, 150)
    return [make_request(f"q{i}", 0.01 * i, np.concatenate([system, rng.integers(0, 1000, 20 + 37 * (i % 5))]),
                         40 + 7 * (i % 4)) for i in range(12)]


@pytest.mark.parametrize(("model", "tp", "blocks", "run_async", "preemptions"),
                         [("gpt-oss-20b", 1, 60, False, 6), ("qwen3-next-80b-a3b", 4, 12, False, 6),
                          ("gpt-oss-20b", 1, 60, True, 4), ("gemma-3-27b", 2, 180, True, 5)])
def test_hybrid_groups_record_the_plain_ops_with_shortcuts(monkeypatch: pytest.MonkeyPatch, model: str, tp: int,
                                                           blocks: int, run_async: bool, preemptions: int) -> None:
    """vLLM's hybrid groups (a window of 128 and full attention; Mamba state and full attention;
    windows of 1024 and full attention), with the sync output and the async: lazy decodes recorded late give every step the same ops, and every block the same order, as
    visiting every sequence; recording changes no table, and the write counts stay one group's."""
    from kvsim.kvcache.hybrid import HybridKVCacheManager

    late = _late_writes(monkeypatch, HybridKVCacheManager)
    cfg = SimConfig(model=model, tensor_parallel=tp, num_gpu_blocks=blocks, record_ops=True,
                    max_num_batched_tokens=256, max_num_seqs=8, async_scheduling=run_async)
    fast = simulate(_hybrid_workload(), cfg)
    assert sum(late) > 50 and max(late) > 1
    slow = simulate(_hybrid_workload(), cfg.replace(shortcuts=False))
    plain = simulate(_hybrid_workload(), cfg.replace(record_ops=False))
    assert fast.summary["preemptions"] == preemptions and fast.manager.num_groups > 1
    for other in (slow, plain):
        pd.testing.assert_frame_equal(fast.steps, other.steps)
        pd.testing.assert_frame_equal(fast.requests, other.requests)
    assert fast.manager.ops.counts == slow.manager.ops.counts
    assert fast.manager.ops.counts - Counter(table=10**9) == plain.manager.ops.counts
    a, b = fast.manager.ops.records(), slow.manager.ops.records()
    assert {op.group for op in a} == set(range(fast.manager.num_groups))
    same_stream(a, b)
