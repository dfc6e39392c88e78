"""`kvsim model`: what kvsim reads from a model and what its cache and steps come to, without a run.

`kvsim model` lists the catalog; `kvsim model NAME|config.json [--gpu --tp --kv-cache-dtype
--gpu-memory-utilization]` prints what was read (layer kinds and windows, parameters), the bytes of a
block, the blocks that fit (and, for a model that mixes layer types, vLLM's hybrid layout), and the
reference batches' step times against the roofline (`sim.studies.roofline`).
"""

from __future__ import annotations

from typing import Annotated

import typer

from kvsim.sim.cli.options import Gpu, Tp


def model(
    name: Annotated[str | None, typer.Argument(help="a catalog model or a config.json (or its folder); none: list the catalog")] = None,
    gpu: Gpu = None,
    tp: Tp = None,
    kv_cache_dtype: Annotated[str | None, typer.Option("--kv-cache-dtype", help="auto|fp8|... as vLLM's [default: auto]")] = None,
    gpu_memory_utilization: Annotated[float | None, typer.Option(help="fraction of GPU memory vLLM may use [default: 0.9]")] = None,
) -> None:
    """Say what kvsim reads from a model and what its KV cache and steps come to."""
    from kvsim.sim.cli.common import fail
    from kvsim.sim.engine.config import ConfigError

    try:
        if name is None:
            typer.echo(_catalog())
            return
        typer.echo(_describe(name, gpu, tp, kv_cache_dtype, gpu_memory_utilization))
    except ConfigError as e:
        raise fail(str(e)) from None


def _catalog() -> str:
    from kvsim.sim.engine.catalog import MODELS
    from kvsim.sim.engine.hf_config import catalog_names, model_spec
    from kvsim.sim.engine.layers import describe_layers, kv_layers

    lines = []
    for n in [*MODELS, *catalog_names()]:
        m = model_spec(n)
        active = f" ({m.active_params() / 1e9:.2f}B active)" if m.active_params() != m.num_params else ""
        lines.append(f"{n:20s} {m.num_params / 1e9:7.2f}B{active}  {describe_layers(kv_layers(m)).split(';')[0]}")
    return "\n".join(lines) + "\n\n`kvsim model NAME` says more; --model path/to/config.json reads your own."


def _describe(name: str, gpu: str | None, tp: int | None, dtype: str | None, utilization: float | None) -> str:
    from kvsim.sim.cli.options import hardware_changes
    from kvsim.sim.cli.run import model_notes
    from kvsim.sim.engine.config import SimConfig
    from kvsim.sim.engine.cost_model import CostModel
    from kvsim.sim.studies.roofline import rows

    changes = hardware_changes(name, gpu, tp)
    changes.update({k: v for k, v in (("kv_cache_dtype", dtype), ("gpu_memory_utilization", utilization)) if v is not None})
    cfg = SimConfig().replace(**changes).validate()
    cost = CostModel.from_config(cfg)
    where = f"{cfg.tensor_parallel} x {cost.gpu.name}"
    lines = model_notes(cfg, cost)
    lines.append(f"weights: {cost.weight_bytes / 1e9:.2f} GB a GPU; the cache gets {cost.kv_memory_bytes(cfg) / 2**30:.2f} GiB "
                 f"a GPU at --gpu-memory-utilization {cfg.gpu_memory_utilization}")
    if cost.placement_error is not None:
        lines.append(f"blocks: none: {cost.placement_error}")
    else:
        blocks = cost.num_gpu_blocks(cfg)
        if cost.layout is not None:
            lines.append(f"blocks: {blocks:,} of {cost.block_size} tokens on {where}, one pool for "
                         f"{len(cost.layout.groups)} groups (a request holds blocks in each)")
        else:
            lines.append(f"blocks: {blocks:,} of {cfg.block_size} tokens ({blocks * cfg.block_size:,} tokens) on {where}")
    for r in rows(cfg.model, cfg.gpu, cfg.tensor_parallel, cfg.kv_cache_dtype):
        bound = max(r.compute_s, r.memory_s)
        lines.append(f"step, {r.batch}: {r.step_s * 1e3:.2f} ms ({r.bound}-bound; the roofline's {bound * 1e3:.2f} ms)")
    return "\n".join(lines)


def register(app: typer.Typer) -> None:
    """Mount `model` on the root `kvsim` app."""
    app.command("model")(model)
