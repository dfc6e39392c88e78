"""Shapes, sizes and seeded data shared by the CUDA kernel tests (`test_kernels_cuda_*.py`).

Shapes come from `sim.engine.catalog` (query heads, KV heads, head dim, layers, sliding
window): Llama-3-8B (32/8 heads, GQA group 4), Llama-3-70B sharded for TP2
(32/4 heads per GPU, group 8, 80 layers), Qwen2.5-7B (28/4, group 7: not a power
of two) and Mistral-7B (32/8, sliding window 4096); fp16 and bf16; block sizes
16 and 32.

Every such test is marked `cuda` (`pytestmark = CUDA_MARKS`): without a GPU the conftest
skips them. Setting KVSIM_CUDA_TESTS_TINY=1 runs the same test bodies at tiny shapes (same
group sizes, block sizes and dtypes; small heads, contexts and windows), on CPU under
Triton's interpreter when there is no GPU (about two minutes), to check the tests
themselves:

    KVSIM_CUDA_TESTS_TINY=1 python -m pytest tests/gpu/test_kernels_cuda_*.py
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
from gpu_env import DEVICE

from kvsim.sim.engine.catalog import get_model

TINY = os.environ.get("KVSIM_CUDA_TESTS_TINY", "") == "1"
CUDA_MARKS = [] if TINY else [pytest.mark.cuda]


@dataclass(frozen=True)
class Shape:
    """One GPU's share of a model: what the kernels see."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    window: int | None


@dataclass(frozen=True)
class Sizes:
    """How big the tests are: real (CUDA) or tiny (interpreter)."""

    blocks: int  # device blocks for the block-op tests
    cpu_blocks: int
    pairs: int
    write_tokens: tuple[int, ...]
    batch: int  # decode batch
    max_ctx: int  # largest context in the decode batch
    long_ctx: int  # the long-context test's longest context
    needle_ctx: int
    window: int  # the sliding window of a model that has one


REAL = Sizes(blocks=384, cpu_blocks=48, pairs=48, write_tokens=(1, 129, 2048), batch=36, max_ctx=8192,
             long_ctx=32768, needle_ctx=8192 + 5, window=0)  # window 0: the model's own
SMALL = Sizes(blocks=24, cpu_blocks=8, pairs=5, write_tokens=(1, 7, 33), batch=6, max_ctx=100,
              long_ctx=300, needle_ctx=150, window=40)
SIZES = SMALL if TINY else REAL

MODELS = ("llama-3-8b", "llama-3-70b-tp2", "qwen2.5-7b", "mistral-7b")
MOVE_MODELS = ("llama-3-8b", "llama-3-70b-tp2")  # block ops only see layers x KV heads x head dim
DTYPES = (torch.float16, torch.bfloat16)
BLOCK_SIZES = (16, 32)


def shape_of(name: str) -> Shape:
    """The catalog model `name` (a "-tpN" suffix: one of N tensor-parallel shards), or its tiny stand-in."""
    base, _, tp = name.partition("-tp")
    m = get_model(base)
    tp = int(tp or 1)
    heads, kv = m.num_heads // tp, m.num_kv_heads // tp
    window = m.sliding_window
    if TINY:
        group = heads // kv
        kv = min(kv, 2)
        return Shape(2, kv * group, kv, 32, SIZES.window if window else None)
    return Shape(m.num_layers, heads, kv, m.head_dim, window)


def ids(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def randn(shape, dtype, seed: int, device=DEVICE) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=g, device=device, dtype=dtype)


def perm(n: int, seed: int, start: int = 0) -> list[int]:
    """start..start+n-1 shuffled (seeded, on the host)."""
    return (torch.randperm(n, generator=torch.Generator().manual_seed(seed)) + start).tolist()
