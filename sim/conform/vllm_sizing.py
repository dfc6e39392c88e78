"""kvsim's block count against vLLM 0.33's own sizing functions, run on the CPU (no weights).

vLLM sizes the KV cache in two steps: the worker profiles a forward pass to find the memory left
for the cache (`available_memory`), and the engine core turns that into a block count with the
layers' KV-cache specs (vllm/v1/core/kv_cache_planning.py `get_kv_cache_groups`, then
`get_kv_cache_config_from_groups`: `available_memory // bytes_per_block`, the bytes one block takes
in the largest group). The first step needs a GPU; kvsim estimates it (weights, activations and
CUDA-graph reserves, `CostModel.activation_reserve_bytes`). The second step is checked here: the
same available memory goes through vLLM's functions with the specs built by vLLM's own classes
(`FullAttentionSpec`, `SlidingWindowSpec`, `ChunkedLocalAttentionSpec`, `MLAAttentionSpec`,
`MambaSpec`) from the model's shape, and kvsim's count must equal vLLM's under the placement kvsim
uses: vLLM's hybrid KV-cache groups for a model that mixes layer kinds where vLLM on CUDA turns
them on (not for chunked local attention, whose count is its `--disable-hybrid-kv-cache-manager`
fallback's). vLLM's count with its hybrid manager on is reported beside it for every mixed model.

`python -m kvsim.sim.conform.vllm_sizing` prints the table for the catalog's models on H100 and
H200 at `--gpu-memory-utilization 0.9` (docs/models.md keeps it).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvsim.sim.engine.config import SimConfig
from kvsim.sim.engine.cost_model import CostModel, smallest_tp
from kvsim.sim.engine.layers import hybrid_layout


@dataclass(frozen=True)
class Sizing:
    """One model on one GPU type: kvsim's block count and vLLM's, for the same memory."""

    model: str
    gpu: str
    tp: int
    available_bytes: int  # per GPU, for the KV cache (kvsim's estimate of vLLM's profiling)
    kvsim_blocks: int | None  # None: kvsim does not size this model's cache
    vllm_blocks: int | None  # vLLM's, placed as kvsim places it (None where kvsim refuses the model)
    vllm_hybrid_blocks: int | None  # vLLM's with its hybrid KV-cache manager on (None: layers all alike)
    kvsim_hybrid_blocks: int | None  # the same from kvsim's grouping (layers.hybrid_layout)
    groups_equal: bool | None  # kvsim's groups (layer indices, in order) are vLLM's


def vllm_specs(cost: CostModel):
    """{layer name: vLLM KVCacheSpec} of every layer, built by vLLM's classes from the model's shape."""
    import torch
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVQuantMode,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    m, tp, bs = cost.model, cost.tensor_parallel, cost.block_size
    fp8 = cost.kv_dtype_bytes == 1
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    quant = KVQuantMode.FP8_PER_TENSOR if fp8 else KVQuantMode.NONE
    heads = max(1, m.num_kv_heads // tp)
    attention = dict(block_size=bs, num_kv_heads=heads, head_size=m.head_dim, dtype=dtype, kv_quant_mode=quant)
    specs = {}
    for i, layer in enumerate(cost.layers):
        if layer.kind == "mla":
            spec = MLAAttentionSpec(block_size=bs, num_kv_heads=1, max_tp_shards=1,
                                    head_size=m.kv_lora_rank + m.qk_rope_head_dim, dtype=dtype,
                                    kv_quant_mode=quant, cache_dtype_str="fp8" if fp8 else "auto")
        elif layer.kind == "sliding_window":
            spec = SlidingWindowSpec(**attention, sliding_window=layer.window)
        elif layer.kind == "chunked_local":
            spec = ChunkedLocalAttentionSpec(**attention, attention_chunk_size=layer.window)
        elif layer.kind == "mamba":  # align mode, padded to the attention page (_align_hybrid_block_size)
            state = torch.float32 if m.state_dtype_bytes == 4 else torch.bfloat16
            spec = MambaSpec(block_size=bs, shapes=m.linear_state_shapes(tp), dtypes=(torch.bfloat16, state),
                             page_size_padded=FullAttentionSpec(**attention).page_size_bytes, mamba_cache_mode="align")
        else:
            spec = FullAttentionSpec(**attention)
        specs[f"model.layers.{i}.attn"] = spec
    return specs


def _vllm_config(cost: CostModel, disable_hybrid: bool):
    """The drivers' VllmConfig (`vllm_setup.stand_in_config`, vLLM's defaults) at the model's length
    and block size, the hybrid manager as asked (set after construction: on this CPU host vLLM would
    turn it off); the sizing functions read the scheduler's and the cache's configs only."""
    import tempfile

    from kvsim.sim.conform.vllm_setup import stand_in_config

    with tempfile.TemporaryDirectory() as tmp:
        config = stand_in_config(tmp, max_model_len=cost.model.max_model_len, cache={"block_size": cost.block_size})
    # what VllmConfig resolves on a CUDA host for a hybrid model (on: vllm/config/vllm.py), or the flag
    config.scheduler_config.disable_hybrid_kv_cache_manager = disable_hybrid
    # the layout the engine core resolves from the backends (resolve_kv_cache_layout); with no page
    # padded for alignment, as here, every layout gives the same bytes a block
    config.cache_config.kv_cache_layout = "LBNHC"
    return config


def vllm_num_blocks(cost: CostModel, available: int, disable_hybrid: bool) -> int:
    """vLLM's `num_blocks` for `available` bytes per GPU (its null block among them)."""
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups

    config = _vllm_config(cost, disable_hybrid)
    groups = get_kv_cache_groups(config, vllm_specs(cost))
    return get_kv_cache_config_from_groups(config, groups, available).num_blocks


def sizing(model: str, gpu: str, tp: int, utilization: float = 0.9) -> Sizing:
    """kvsim's and vLLM's block counts for `model` on `tp` GPUs of type `gpu`."""
    cfg = SimConfig(model=model, gpu=gpu, tensor_parallel=tp, gpu_memory_utilization=utilization).validate()
    cost = CostModel.from_config(cfg)
    available = int(cost.kv_memory_bytes(cfg))
    mixed = len({layer.kind for layer in cost.layers}) > 1
    ours = None if cost.placement_error else cost.num_gpu_blocks(cfg)
    # kvsim places a mixed model in vLLM's hybrid groups where vLLM on CUDA does (CostModel.layout),
    # else in its fallback; vLLM's count is taken the same way
    fallback = mixed and ours is not None and cost.layout is None
    theirs = None if ours is None else vllm_num_blocks(cost, available, disable_hybrid=fallback)
    hybrid = vllm_num_blocks(cost, available, disable_hybrid=False) if mixed and ours is not None else None
    ours_hybrid = same = None
    if hybrid is not None:
        layout = cost.layout or hybrid_layout(cost.layers, cost.model.name)
        ours_hybrid = available // layout.bytes_per_block
        same = [list(g.layers) for g in layout.groups] == vllm_groups(cost)
    return Sizing(model, gpu, tp, available, ours, theirs, hybrid, ours_hybrid, same)


def vllm_groups(cost: CostModel) -> list[list[int]]:
    """vLLM's hybrid-manager groups of the model's layers, as layer indices."""
    from vllm.v1.core.kv_cache_planning import get_kv_cache_groups

    groups = get_kv_cache_groups(_vllm_config(cost, False), vllm_specs(cost))
    return [[int(name.split(".")[2]) for name in g.layer_names] for g in groups]


def table(models: list[str], gpus: tuple[str, ...] = ("h100-sxm", "h200")) -> list[Sizing]:
    """One `Sizing` a model and GPU, each at its smallest tensor-parallel degree (none where eight
    GPUs do not hold the model)."""
    fits = [(m, g, smallest_tp(m, g)) for m in models for g in gpus]
    return [sizing(m, g, tp) for m, g, tp in fits if tp is not None]


def main() -> None:
    from kvsim.sim.engine.hf_config import catalog_names

    rows = table(list(catalog_names()))
    print("| model | GPU | TP | KV memory per GPU (GiB) | kvsim blocks | vLLM 0.33 blocks | vLLM, hybrid manager |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ours = f"{r.kvsim_blocks:,}" if r.kvsim_blocks is not None else "refused"
        hybrid = (f"{r.vllm_hybrid_blocks:,}" if r.vllm_hybrid_blocks is not None
                  else "(same)" if r.kvsim_blocks is not None else "-")
        theirs = f"{r.vllm_blocks:,}" if r.vllm_blocks is not None else "-"
        print(f"| {r.model} | {r.gpu} | {r.tp} | {r.available_bytes / 2**30:.2f} | {ours} | {theirs} | {hybrid} |")


if __name__ == "__main__":
    main()
