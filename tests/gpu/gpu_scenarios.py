"""Small recorded runs for the replay tests: a manager driven by hand, or by kvcache.replay."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvsim.kvcache.manager import KVCacheManager
from kvsim.kvcache.replay import replay
from kvsim.kvcache.sequence import Sequence


def save_run(m: KVCacheManager, folder: Path, **config) -> Path:
    """The files a replay reads: ops, token ids and a config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    m.ops.save(folder)
    cfg = {"block_size": m.block_size, "num_gpu_blocks": m.pool.num_blocks, "num_cpu_blocks": m.cpu.num_blocks,
           **config}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _seq(sid: str, tokens, uid: int) -> Sequence:
    return Sequence(sid, np.asarray(tokens, dtype=np.int64), uid=uid)


def _prefill(m: KVCacheManager, s: Sequence) -> int:
    blocks, hit = m.get_computed_blocks(s)
    assert m.allocate_slots(s, s.num_tokens - hit, hit, blocks) is not None
    s.num_computed_tokens = s.num_tokens
    s.append_tokens(1)
    return hit


def _decode(m: KVCacheManager, *seqs: Sequence) -> None:
    for s in seqs:
        assert m.allocate_slots(s, 1) is not None
        s.num_computed_tokens += 1
        s.append_tokens(1)


def lifecycle(folder: Path) -> tuple[Path, dict]:
    """Prefix hit, fork with copy-on-write, swap out and in, defrag moves, then free all.

    Block size 4, 24 GPU blocks, 16 CPU blocks; the ops are listed in test_replay.py.
    The block ids the tests name were worked out under vLLM 0.23's free order (every
    freed block appended), which this scenario keeps: it is about op kinds, not order.
    """
    m = KVCacheManager(24, 4, num_cpu_blocks=16, record_ops=True, defrag_threshold=1, vllm_version="0.23")
    facts = {}
    filler = _seq("F", range(100, 117), 0)  # holds low ids, so that freeing it leaves holes
    a = _seq("A", range(1, 11), 1)  # 10 tokens: 2 full blocks and a partial one
    b = _seq("B", [*range(1, 9), 50, 51], 2)  # shares A's 2 full blocks
    m.ops.step = 0
    _prefill(m, filler)
    _prefill(m, a)
    a1 = m.fork(a, "A/1", 3)  # parallel sampling: shares A's partial block until one writes
    m.ops.step = 1
    _decode(m, a, a1)  # A copies the shared partial block (copy-on-write)
    facts["hit"] = _prefill(m, b)
    m.ops.step = 2
    _decode(m, a, a1, b)
    m.ops.step = 3
    facts["swapped_out"] = m.swap_out([b])
    _decode(m, a, a1)
    m.ops.step = 4
    m.free(filler)
    facts["swapped_in"] = m.swap_in([b])  # B's partial block comes back by copy
    _decode(m, a, a1, b)
    m.ops.step = 5
    _decode(m, a, a1, b)
    m.free(a)
    m.ops.step = 6
    facts["moves"] = m.defragment()
    _decode(m, a1, b)
    m.ops.step = 7
    _decode(m, a1, b)
    m.free(a1)
    m.free(b)
    facts["cow"] = m.num_cow_copies
    return save_run(m, folder), facts


@dataclass
class Req:
    """Just what kvcache.replay reads from a request."""

    id: str
    prompt: np.ndarray
    output_len: int
    output: np.ndarray | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)


def concurrent(folder: Path, sliding_window: int | None = None) -> Path:
    """Eight requests sharing two system prompts through kvcache.replay's concurrent loop:
    prefix hits, evictions and recompute preemptions in 16 tight GPU blocks."""
    rng = np.random.default_rng(7)
    systems = [rng.integers(0, 1000, 9), rng.integers(1000, 2000, 6)]
    reqs = [Req(f"r{i}", np.concatenate([systems[i % 2], rng.integers(0, 5000, 2 + i % 3)]), 3 + i % 4)
            for i in range(8)]
    m = KVCacheManager(16, 4, record_ops=True, sliding_window=sliding_window)
    replay(reqs, m, max_running=3)
    return save_run(m, folder, sliding_window=sliding_window)


def simulated(folder: Path, requests: int = 6, gpu_blocks: int = 10, forks: bool = False) -> Path:
    """The simulator's own engine on a tight cache: swap preemption, defrag moves, prefix hits, evictions
    (with `forks`, every third request samples twice: copy-on-write copies too)."""
    from kvsim.sim.engine.config import SimConfig
    from kvsim.sim.engine.run import simulate
    from kvsim.workloads.request import make_request

    rng = np.random.default_rng(3)
    system = rng.integers(0, 1000, 10)
    reqs = [make_request(f"q{i}", 0.001 * i, np.concatenate([system, rng.integers(0, 1000, 3 + i % 5)]), 6 + i % 3,
                         n=2 if forks and i % 3 == 0 else 1) for i in range(requests)]
    cfg = SimConfig(block_size=4, num_gpu_blocks=gpu_blocks, num_cpu_blocks=32, preemption="swap", defrag_threshold=2,
                    record_ops=True, max_num_batched_tokens=32, max_num_seqs=6, parallel_sampling="fork")
    result = simulate(reqs, cfg)
    folder.mkdir(parents=True, exist_ok=True)
    result.manager.ops.save(folder)
    (folder / "config.json").write_text(json.dumps(cfg.to_dict()))
    return folder


def write_ops(folder: Path, ops) -> None:
    """Overwrite a run's ops.parquet with `ops` (a fault-injected stream)."""
    from kvsim.kvcache.ops import OpLog

    log = OpLog(enabled=True)
    for op in ops:
        log.step = op.step
        log.emit(op.kind, op.a, op.b, op.c, op.seq, op.hash, op.pos)
    log.to_parquet(folder / "ops.parquet")


def every_kind(folder: Path) -> Path:
    """`simulated` with parallel sampling too: a run whose ops hold every kind a fault can corrupt
    (copy-on-write copies, swaps, defrag moves, prefix hits, writes)."""
    return simulated(folder, requests=8, gpu_blocks=12, forks=True)


def hybrid(folder: Path, model: str, tensor_parallel: int = 1, gpu_blocks: int = 60) -> Path:
    """`kvsim run --record-ops` of a model in vLLM's hybrid KV-cache groups on a tight cache, written
    as a run folder: a shared system prompt (prefix hits), prompts of five lengths, preemptions."""
    from kvsim.sim.engine.config import SimConfig
    from kvsim.sim.engine.run import simulate
    from kvsim.sim.studies.run_folder import write_run
    from kvsim.workloads.request import make_request

    rng = np.random.default_rng(3)
    system = rng.integers(0, 1000, 150)
    reqs = [make_request(f"q{i}", 0.01 * i, np.concatenate([system, rng.integers(0, 1000, 20 + 37 * (i % 5))]),
                         40 + 7 * (i % 4)) for i in range(12)]
    cfg = SimConfig(model=model, tensor_parallel=tensor_parallel, num_gpu_blocks=gpu_blocks, record_ops=True,
                    max_num_batched_tokens=256, max_num_seqs=8)
    return write_run(simulate(reqs, cfg), folder, plots=False)
