"""Shared set-up for the vLLM 0.33.0 reference drivers: whether vLLM is importable, and
vLLM's own objects (KV-cache config, block hasher, requests) built from kvsim's requests.

vllm is imported lazily: this module imports without it, and `vllm_available()` says how
to install it (CPU only).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from typing import Any

import numpy as np

from kvsim.kvcache.sequence import Sequence

VLLM_VERSION = "0.33.0"
INSTALL_HINT = "bash .ci/install_vllm_cpu.sh"
STALL_STEPS = 1000  # consecutive empty steps with requests left before run_scheduler gives up

Request = Any  # workloads.request.Request (id, arrival, prompt_len, output_len, prompt, output)
FINISHED, TRUNCATED, REJECTED = "finished", "truncated", "rejected"


def quiet_offline_env() -> None:
    # NOTE: set before vllm is first imported; values the user already set win.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # ERROR: on a CPU-only machine vLLM warns that its compiled ops (vllm._C) are missing;
    # kvsim drives only the scheduler and cache manager, which never need them.
    level = os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # vLLM leaves its loggers unconfigured when imported as a library, so the level goes on directly
    logging.getLogger("vllm").setLevel(level.upper())


def vllm_version() -> str | None:
    """The installed vllm distribution's version (without importing it), or None."""
    from importlib import metadata

    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


@functools.cache
def vllm_available() -> str | None:
    """None if vLLM 0.33.0's scheduler and cache manager import here, else how to install it."""
    version = vllm_version()
    if version is None:
        return f"vllm is not installed; install vLLM {VLLM_VERSION} (CPU only): `{INSTALL_HINT}`"
    if version != VLLM_VERSION:
        return f"vllm {version} is installed but kvsim matches {VLLM_VERSION}; run `{INSTALL_HINT}`"
    quiet_offline_env()
    try:
        import vllm.config  # noqa: F401
        import vllm.v1.core.kv_cache_manager  # noqa: F401
        import vllm.v1.core.sched.scheduler  # noqa: F401
        import vllm.v1.outputs  # noqa: F401
    except Exception as e:  # a missing dependency surfaces as any of several errors
        return f"vllm {version} does not import ({type(e).__name__}: {e}); run `{INSTALL_HINT}`"
    return None


def require_vllm() -> None:
    msg = vllm_available()
    if msg is not None:
        raise RuntimeError(msg)


def token_ids(req: Request, uid: int) -> list[int]:
    """Prompt then every token the request will sample, as kvsim numbers them."""
    seq = Sequence(req.id, req.prompt, uid=uid, output=req.output)
    return seq.token_ids(0, req.prompt_len + max(req.output_len, 1)).tolist()


PrefixName = tuple[int, bytes]  # a prefix's length in tokens and a digest of its tokens (`prefix_names`)


def prefix_names(tokens: list[int], block_size: int) -> list[PrefixName]:
    """A name for the prefix each full block of `tokens` ends, the k-th for its first k + 1 blocks:
    its length in tokens and a 128-bit digest chained block by block over the tokens. Equal prefixes
    get equal names, and two different ones get different names but for a digest collision. This
    is how the event check matches kvsim's hashes to vLLM's (the two hash functions differ)
    without keeping every prefix's tokens (a 12k-token prompt's prefixes hold 4.5M token ids)."""
    data = np.asarray(tokens, dtype=np.int64).tobytes()
    step, digest, out = 8 * block_size, b"", []
    for k in range(len(tokens) // block_size):
        digest = hashlib.blake2b(digest + data[k * step:(k + 1) * step], digest_size=16).digest()
        out.append(((k + 1) * block_size, digest))
    return out


# the stand-in model the drivers give vLLM: a one-layer Llama, whose attention reports one KV head
# of 32 (hidden 64 / 2 heads) in float32; its shape sizes nothing (the block count is given)
STAND_IN = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
            "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
            "num_hidden_layers": 1, "vocab_size": 256, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
            "tie_word_embeddings": False}


def stand_in_config(tmp: str, *, max_model_len: int, cache: dict[str, Any], scheduler: Any = None,
                    kv_events: bool = False, kv_transfer: dict[str, Any] | None = None):
    """The VllmConfig `vllm serve` builds for the stand-in model written into `tmp`: vLLM's config
    objects with every default vLLM's own, `cache` the CacheConfig fields given on the command
    line (block size, prefix caching, ...), `scheduler` a SchedulerConfig (None: the default);
    `kv_events`: as `--kv-events-config '{"enable_kv_cache_events": true, "publisher": "null"}'`
    (the block pool queues KV events; the caller takes over the publisher); `kv_transfer`: as
    `--kv-transfer-config '{"kv_connector": "NixlConnector", "kv_role": "kv_both",
    "kv_connector_extra_config": kv_transfer}'`, P/D disaggregation's connector (its engine id vLLM's
    random one)."""
    import json

    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVEventsConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump({**STAND_IN, "max_position_embeddings": max_model_len}, f)
    model_config = ModelConfig(model=tmp, skip_tokenizer_init=True, max_model_len=max_model_len,
                               dtype="float32", seed=0)
    if scheduler is None:
        scheduler = SchedulerConfig(max_model_len=max_model_len, is_encoder_decoder=False)
    events = KVEventsConfig(enable_kv_cache_events=True, publisher="null") if kv_events else None
    transfer = None if kv_transfer is None else KVTransferConfig(
        kv_connector="NixlConnector", kv_role="kv_both", kv_connector_extra_config=dict(kv_transfer))
    return VllmConfig(model_config=model_config, cache_config=CacheConfig(**cache), scheduler_config=scheduler,
                      device_config=DeviceConfig(device="cpu"), kv_events_config=events, kv_transfer_config=transfer)


def stand_in_spec(block_size: int, sliding_window: int | None = None, chunk: int | None = None):
    """The KV-cache spec the stand-in's attention layer reports (attention.py get_kv_cache_spec):
    full attention, a sliding window, or chunked local attention (chunked_local_attention.py)."""
    import torch
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        SlidingWindowSpec,
    )

    kw = {"block_size": block_size, "num_kv_heads": STAND_IN["num_key_value_heads"],
          "head_size": STAND_IN["hidden_size"] // STAND_IN["num_attention_heads"], "dtype": torch.float32}
    if chunk is not None:
        return ChunkedLocalAttentionSpec(**kw, attention_chunk_size=chunk)
    return FullAttentionSpec(**kw) if sliding_window is None else SlidingWindowSpec(**kw, sliding_window=sliding_window)


def mamba_spec(block_size: int, checkpoints: bool):
    """The spec a gated-delta-net layer reports in align mode (mamba/abstract.py
    `MambaBase.get_kv_cache_spec`, with qwen_gdn_linear_attn.py's checkpoint fields where FlashInfer
    exports prefill checkpoints): a small stand-in state padded to the stand-in's attention page, as
    `_align_hybrid_block_size` pads it; block size, cache mode and checkpoint grid `vllm serve`'s."""
    import torch
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(shapes=((1, 4), (1, 4, 4)), dtypes=(torch.float32, torch.float32), block_size=block_size,
                     page_size_padded=stand_in_spec(block_size).page_size_bytes,
                     mamba_type=MambaAttentionBackendEnum.GDN_ATTN, mamba_cache_mode="align",
                     num_prefill_checkpoint_blocks=int(checkpoints),
                     prefill_checkpoint_alignment=block_size if checkpoints else None)


def layer_specs(block_size: int, sliding_window: int | None = None, layers: Any = None,
                mamba_checkpoints: bool = False) -> dict[str, Any]:
    """{layer name: spec} the model's attention layers report: the stand-in's one layer, or with
    `layers` (kvsim's `LayerKV`s of a model mixing kinds) one stand-in-sized layer of each layer's
    kind and window, in order (their page size is the stand-in's; the block count is given); a
    Mamba-state layer as `mamba_spec` (`mamba_checkpoints`: it exports prefill checkpoints)."""
    if layers is None:
        return {"model.layers.0.self_attn.attn": stand_in_spec(block_size, sliding_window)}
    specs = {}
    for i, layer in enumerate(layers):
        if layer.kind == "mamba":
            specs[f"model.layers.{i}.linear_attn"] = mamba_spec(block_size, mamba_checkpoints)
            continue
        if layer.kind == "none":  # an MLP or MoE layer reports no KV-cache spec
            continue
        window = layer.window if layer.kind == "sliding_window" else None
        chunk = layer.window if layer.kind == "chunked_local" else None
        specs[f"model.layers.{i}.self_attn.attn"] = stand_in_spec(block_size, window, chunk)
    return specs


def kv_cache_config(vllm_config: Any, num_blocks: int, sliding_window: int | None = None, layers: Any = None,
                    mamba_checkpoints: bool = False):
    """The KVCacheConfig the engine core plans for the stand-in model, as `vllm serve
    --num-gpu-blocks-override num_blocks` plans it (vllm/v1/core/kv_cache_planning.py): the layers'
    specs as their Attention reports them (`layer_specs`), grouped by `get_kv_cache_groups` and
    sized by `get_kv_cache_config_from_groups`, which also carries the cache config's
    `prefix_cache_retention_interval` (vLLM's default 0: a sliding window hashes only the blocks a
    later request can resume from). A hand-built KVCacheConfig would default that field to None
    (dense) and check a rule `vllm serve` does not run. With `layers` (a model mixing kinds), the
    hybrid manager is on, as VllmConfig resolves it on a CUDA host where kvsim runs it so
    (vllm/config/vllm.py; on this CPU host vLLM would turn it off). With Mamba-state layers the
    cache config is what `vllm serve` leaves it (model_executor/models/config.py
    `MambaModelConfig.verify_and_update_config`, then `_align_hybrid_block_size`): "align" mode,
    the Mamba block size the (raised) block size given."""
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups

    cache = vllm_config.cache_config
    if layers is not None and any(layer.kind == "mamba" for layer in layers):
        cache.mamba_cache_mode, cache.mamba_block_size = "align", cache.block_size
    specs = layer_specs(cache.block_size, sliding_window, layers, mamba_checkpoints)
    cache.num_gpu_blocks_override = num_blocks
    if layers is not None:
        vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False
    if cache.kv_cache_layout is None:  # the engine core resolves it from the backends; any fits these layers
        cache.kv_cache_layout = "LBNHC"
    groups = get_kv_cache_groups(vllm_config, specs)
    page = next(iter(specs.values())).page_size_bytes
    per_block = max(len(g.layer_names) for g in groups) * page
    config = get_kv_cache_config_from_groups(vllm_config, groups, num_blocks * per_block)
    assert config.num_blocks == num_blocks
    return config


def block_hasher(block_size: int, hash_algo: str):
    """The per-request block hasher vLLM's engine core builds when prefix caching is on."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name(hash_algo)
    init_none_hash(hash_fn)
    return get_request_block_hasher(block_size, hash_fn)


def vllm_request(req: Request, tokens: list[int], hasher, *, arrival: float = 0.0,
                 kv_transfer_params: dict[str, Any] | None = None):
    """vLLM's Request for kvsim's `req`; `kv_transfer_params`: what a P/D proxy sends with it (the
    OpenAI server puts them in the sampling params' extra_args, where vLLM's Request reads them)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request as VllmRequest

    extra = None if kv_transfer_params is None else {"kv_transfer_params": kv_transfer_params}
    params = SamplingParams(max_tokens=max(req.output_len, 1), ignore_eos=True, extra_args=extra)
    return VllmRequest(
        request_id=req.id, prompt_token_ids=tokens[: req.prompt_len], sampling_params=params,
        pooling_params=None, arrival_time=arrival, priority=req.priority, block_hasher=hasher,
    )


def check_ids(reqs: list[Request]) -> None:
    seen: set[str] = set()
    for r in reqs:
        if r.id in seen:
            raise ValueError(f"request id {r.id!r} appears twice; vLLM needs unique ids")
        seen.add(r.id)


# --------------------------------------------------------------------------- manager replay
