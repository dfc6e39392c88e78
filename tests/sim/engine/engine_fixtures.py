"""Helpers for the engine, scheduler and run tests: a flat cost model, tiny requests, a stepper, and
catalog models with a small window (the `window_models` fixture of this folder's conftest)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvsim.kvcache.manager import KVCacheManager
from kvsim.sim.engine.batch import Batch
from kvsim.sim.engine.config import SimConfig
from kvsim.sim.engine.metrics import RequestLog
from kvsim.sim.engine.run import RunResult, simulate
from kvsim.sim.engine.scheduler import Scheduler
from kvsim.workloads.request import Request, Workload, make_request

if TYPE_CHECKING:
    import pytest


def mamba_turns() -> list[Request]:
    """Three turns for a Mamba decode side (qwen3-next at TP 8 on an H100: blocks of 192): r0, 500
    tokens; r1, r0's prompt and 100 more; r2, r0's first 384 tokens and one more."""
    base = np.arange(500, dtype=np.int32)
    return [Request(id="r0", arrival=0.0, prompt_len=500, output_len=5, _prompt=base),
            Request(id="r1", arrival=5.0, prompt_len=600, output_len=5,
                    _prompt=np.concatenate([base, np.arange(9000, 9100, dtype=np.int32)])),
            Request(id="r2", arrival=10.0, prompt_len=385, output_len=5,
                    _prompt=np.concatenate([base[:384], np.array([7777], dtype=np.int32)]))]


class FlatCost:
    """Stand-in cost model: every step takes `step_s` seconds; records what it was asked."""

    sliding_window = None

    def __init__(self, step_s: float = 1.0):
        self.step_s = step_s
        self.calls: list[tuple] = []
        self.chunks: list[list[tuple[int, int]]] = []  # each step's prefill chunks (prior, new)

    def num_gpu_blocks(self, cfg: SimConfig) -> int:
        return cfg.num_gpu_blocks

    def step_time(self, prefill, decode, context, num_seqs, op_counts, chunks=()) -> float:
        self.calls.append((prefill, decode, context, num_seqs, dict(op_counts)))
        self.chunks.append(list(chunks))
        return self.step_s


def req(rid: str, arrival: float, prompt, output_len: int, **kw) -> Request:
    """A request; `prompt` is a token count (fresh tokens from a per-id range) or token ids."""
    if isinstance(prompt, int):
        base = 1000 * (sum(map(ord, rid)) % 997) * 100
        prompt = np.arange(base, base + prompt)
    return make_request(rid, arrival, prompt, output_len, **kw)


def run(requests: list[Request], step_s: float = 1.0, **cfg) -> RunResult:
    """Simulate `requests` with the flat cost model; cfg defaults to 16 blocks of 4 tokens."""
    cfg = {"block_size": 4, "num_gpu_blocks": 16, **cfg}
    return simulate(Workload.from_list(requests, "test"), SimConfig(**cfg), cost_model=FlatCost(step_s))


def make_scheduler(**cfg) -> Scheduler:
    """A scheduler over a fresh manager (16 blocks of 4 tokens unless given)."""
    c = SimConfig(**{"block_size": 4, "num_gpu_blocks": 16, **cfg}).validate()
    m = KVCacheManager(
        c.num_gpu_blocks, c.block_size, num_cpu_blocks=c.num_cpu_blocks, watermark=c.watermark,
        enable_caching=c.enable_prefix_caching,
    )
    return Scheduler(c, m, RequestLog())


def step(s: Scheduler, t: float) -> list[tuple[str, int]]:
    """One step from `t` to `t + 1`: the (sequence id, tokens) it computed, in batch order."""
    b: Batch = s.schedule(t)
    pos = {id(x): k for k, x in enumerate(s.running)}  # batch order is running order
    lazy = [x for x in s.running if x.since >= 0]  # decoding without being visited
    batch = sorted([*((x, 1) for x in [*b.decodes, *lazy]), *zip(b.lives, b.tokens, strict=True)],
                   key=lambda e: pos[id(e[0])])
    s.update(b, t + 1)
    return [(live.seq.seq_id, n) for live, n in batch]


def small_window_model(tmp_path_factory: pytest.TempPathFactory, window: int, base: str) -> str:
    """A catalog model's published config with a small window (`window` tokens), so short requests
    move it: gpt-oss-20b (a window group and a full one) or gemma-3-12b (five window groups, one full)."""
    import kvsim.sim.engine as engine

    d = json.loads((Path(engine.__file__).parent / "configs" / f"{base}.json").read_text())
    d.get("text_config", d)["sliding_window"] = window
    path = tmp_path_factory.mktemp(f"{base}-w{window}") / "config.json"
    path.write_text(json.dumps(d))
    return str(path)


GROUPS = {"gpt-oss-20b": 2, "gemma-3-12b": 6}  # each small-window model's KV-cache groups
WINDOW_MODELS = [(w, base) for w in (32, 48) for base in GROUPS]
