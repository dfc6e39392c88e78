"""The cost model's step time against the roofline, for the catalog's models.

For one batch, the roofline's bounds are the time the step's FLOPs take at the GPU's peak and the
time its bytes (weights, the experts the batch touches, the KV cache read, gated-delta-net
state) take at the memory bandwidth, each per GPU with tensor parallelism. The cost model charges
max(compute / efficiency, memory / efficiency), plus the tensor-parallel all-reduce and the
per-step overhead (`sim.engine.cost_model`); the ratio to the larger bound is what its
efficiency factors and overheads add.

Two reference batches: a decode step of 64 sequences with 2,048 tokens of context each, and a
prefill chunk of 2,048 tokens with no context. Each model runs on the fewest GPUs (1, 2, 4, 8) that
hold it with a cache at --gpu-memory-utilization 0.9.

`python -m kvsim.sim.studies.roofline [gpu]` prints the table the README keeps.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvsim.sim.engine.config import SimConfig
from kvsim.sim.engine.cost_model import Calibration, CostModel, smallest_tp

# (prefill tokens, decode tokens, context tokens, sequences) of each reference batch
BATCHES = {"decode 64 x 2k": (0, 64, 64 * 2048, 64), "prefill 2k": (2048, 0, 2048, 1)}
IDEAL = Calibration(compute=1.0, memory=1.0, overhead_s=0.0)


@dataclass(frozen=True)
class Row:
    """One model, GPU and batch: the roofline's bounds and the cost model's step, in seconds."""

    model: str
    gpu: str
    tp: int
    batch: str
    compute_s: float
    memory_s: float
    step_s: float

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s > self.memory_s else "memory"


def rows(model: str, gpu: str, tp: int, kv_cache_dtype: str = "auto") -> list[Row]:
    """The reference batches' bounds and steps for `model` on `tp` GPUs of type `gpu`."""
    cfg = SimConfig(model=model, gpu=gpu, tensor_parallel=tp, kv_cache_dtype=kv_cache_dtype).validate()
    cost = CostModel.from_config(cfg)
    ideal = CostModel(cost.model, cost.gpu, tp, cost.block_size, replace(IDEAL), kv_dtype_bytes=cost.kv_dtype_bytes)
    out = []
    for name, batch in BATCHES.items():
        compute, memory = ideal.bounds(*batch)
        out.append(Row(model, gpu, tp, name, compute, memory, cost.step_time(*batch)))
    return out


def table(models: list[str], gpu: str = "h100-sxm") -> list[Row]:
    """`rows` for each model that eight GPUs of type `gpu` hold."""
    out = []
    for m in models:
        tp = smallest_tp(m, gpu)
        if tp is not None:
            out += rows(m, gpu, tp)
    return out


def markdown(table_rows: list[Row]) -> str:
    """The table as the README shows it (milliseconds)."""
    lines = ["| model | GPUs | batch | compute bound (ms) | memory bound (ms) | kvsim step (ms) | step / bound |",
             "|---|---|---|---|---|---|---|"]
    for r in table_rows:
        bound = max(r.compute_s, r.memory_s)
        lines.append(f"| {r.model} | {r.tp} x {r.gpu} | {r.batch} | {r.compute_s * 1e3:.2f} | {r.memory_s * 1e3:.2f} "
                     f"| {r.step_s * 1e3:.2f} | {r.step_s / bound:.2f} ({r.bound}) |")
    return "\n".join(lines)


def main() -> None:
    import sys

    from kvsim.sim.engine.catalog import MODELS
    from kvsim.sim.engine.hf_config import catalog_names

    gpu = sys.argv[1] if len(sys.argv) > 1 else "h100-sxm"
    print(markdown(table([*MODELS, *catalog_names()], gpu)))


if __name__ == "__main__":
    main()
