"""The data-movement kernels against their plain-torch twins in `gpu.reference`, on CUDA, at the
catalog models' shapes (see `cuda_cases`): write_kv, copy_blocks, exchange_blocks and
swap_blocks (both methods, both ways) must be bit-exact, also past 2^31 elements.
"""

from __future__ import annotations

import pytest
import torch
from cuda_cases import (
    BLOCK_SIZES,
    CUDA_MARKS,
    DTYPES,
    MOVE_MODELS,
    SIZES,
    TINY,
    Shape,
    ids,
    perm,
    randn,
    shape_of,
)
from gpu_env import DEVICE, HAS_CUDA

from kvsim.gpu.kernels import copy_blocks, exchange_blocks, swap_blocks, write_kv
from kvsim.gpu.reference import copy_blocks_ref, exchange_blocks_ref, write_kv_ref
from kvsim.gpu.storage import PagedKVStorage

pytestmark = CUDA_MARKS


def sync() -> None:
    if HAS_CUDA:
        torch.cuda.synchronize()


@pytest.mark.parametrize("tokens", SIZES.write_tokens)
@pytest.mark.parametrize("bs", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("model", MOVE_MODELS)
def test_write_kv_bit_exact(model, dtype, bs, tokens):
    """K/V as strided views of a fused qkv projection, scattered to random slots (some -1)
    of caches full of other data: equal to the reference everywhere, untouched elsewhere."""
    s = shape_of(model)
    nb = max(SIZES.blocks, -(-2 * tokens // bs) + 1)
    qkv = randn((tokens, s.heads + 2 * s.kv_heads, s.head_dim), dtype, seed=tokens)
    key, value = qkv[:, s.heads:s.heads + s.kv_heads], qkv[:, s.heads + s.kv_heads:]
    slots = torch.tensor(perm(nb * bs, seed=bs)[:tokens], device=DEVICE)
    if tokens > 1:
        slots[::7] = -1  # padding
    kc = randn((nb, bs, s.kv_heads, s.head_dim), dtype, seed=1)
    vc = randn((nb, bs, s.kv_heads, s.head_dim), dtype, seed=2)
    k_ref, v_ref = kc.clone(), vc.clone()
    write_kv(key, value, kc, vc, slots)
    write_kv_ref(key, value, k_ref, v_ref, slots)
    assert torch.equal(kc, k_ref) and torch.equal(vc, v_ref)
    t = int(torch.nonzero(slots >= 0)[-1])
    slot = int(slots[t])
    assert torch.equal(kc[slot // bs, slot % bs], key[t]) and torch.equal(vc[slot // bs, slot % bs], value[t])


def _storage(s: Shape, dtype, bs: int, blocks: int, cpu_blocks: int = 0, seed: int = 0) -> PagedKVStorage:
    st = PagedKVStorage(s.layers, blocks, bs, s.kv_heads, s.head_dim, num_cpu_blocks=cpu_blocks, dtype=dtype,
                        device=DEVICE)
    st.gpu.copy_(randn(st.gpu.shape, dtype, seed=seed))
    if cpu_blocks:
        st.cpu.copy_(randn(st.cpu.shape, dtype, seed=seed + 1))  # generated on the device: faster
    return st


def _cow_pairs(nb: int, n: int, seed: int) -> torch.Tensor:
    """n copy pairs among blocks 1..nb-1: distinct dsts, none of them a src; the last few
    fork one src to several dsts (copy-on-write of a shared prefix)."""
    p = perm(nb - 1, seed, start=1)
    src, dst = p[:n], p[n:2 * n]
    src[-3:] = [src[0]] * 3
    return torch.tensor(list(zip(src, dst, strict=True)), device=DEVICE)


@pytest.mark.parametrize("bs", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("model", MOVE_MODELS)
def test_copy_blocks_bit_exact(model, dtype, bs):
    s = shape_of(model)
    st = _storage(s, dtype, bs, SIZES.blocks)
    want = st.gpu.clone()
    for i, index_dtype in enumerate((torch.int64, torch.int32)):
        pairs = _cow_pairs(SIZES.blocks, SIZES.pairs, seed=bs + i).to(index_dtype)
        copy_blocks(st.gpu, st.gpu, pairs)
        copy_blocks_ref(want, want, pairs)
        assert torch.equal(st.gpu, want)
    # and between two tensors (src untouched)
    other = torch.zeros_like(st.gpu)
    pairs = _cow_pairs(SIZES.blocks, SIZES.pairs, seed=bs + 2)
    copy_blocks(st.gpu, other, pairs)
    ref = torch.zeros_like(st.gpu)
    copy_blocks_ref(st.gpu, ref, pairs)
    assert torch.equal(other, ref) and torch.equal(st.gpu, want)


@pytest.mark.parametrize("bs", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("model", MOVE_MODELS)
def test_exchange_blocks_bit_exact(model, dtype, bs):
    s = shape_of(model)
    st = _storage(s, dtype, bs, SIZES.blocks)
    before = st.gpu.clone()
    want = st.gpu.clone()
    p = perm(SIZES.blocks, seed=bs)
    pairs = torch.tensor(p[:2 * SIZES.pairs], device=DEVICE).view(-1, 2)
    exchange_blocks(st.gpu, pairs)
    exchange_blocks_ref(want, pairs)
    assert torch.equal(st.gpu, want)
    a, b = int(pairs[0, 0]), int(pairs[0, 1])
    assert torch.equal(st.gpu[:, :, a], before[:, :, b]) and torch.equal(st.gpu[:, :, b], before[:, :, a])
    exchange_blocks(st.gpu, pairs.flip(1).contiguous().to(torch.int32))  # and back
    assert torch.equal(st.gpu, before)


@pytest.mark.parametrize("method", ["kernel", "torch"])
@pytest.mark.parametrize("bs", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("model", MOVE_MODELS)
def test_swap_blocks_bit_exact_both_ways(model, dtype, bs, method):
    """Device -> pinned host pool, then host -> device, against the reference copy."""
    s = shape_of(model)
    st = _storage(s, dtype, bs, SIZES.blocks, SIZES.cpu_blocks)
    n = min(SIZES.pairs, SIZES.cpu_blocks)
    gpu_ids = perm(SIZES.blocks - 1, seed=bs, start=1)
    out_pairs = torch.tensor(list(zip(gpu_ids[:n], perm(SIZES.cpu_blocks, seed=bs + 1)[:n], strict=True)))
    want = st.cpu.clone()
    copy_blocks_ref(st.gpu, want, out_pairs)
    swap_blocks(st.gpu, st.cpu, out_pairs.to(DEVICE) if method == "kernel" else out_pairs, method)
    sync()  # the kernel writes the pinned pool asynchronously
    assert torch.equal(st.cpu, want)

    st.cpu.copy_(randn(st.cpu.shape, dtype, seed=7))
    in_pairs = torch.tensor(list(zip(perm(SIZES.cpu_blocks, seed=bs + 2)[:n], gpu_ids[-n:], strict=True)))
    want = st.gpu.clone()
    copy_blocks_ref(st.cpu, want, in_pairs)
    swap_blocks(st.cpu, st.gpu, in_pairs.to(DEVICE) if method == "kernel" else in_pairs, method)
    assert torch.equal(st.gpu, want)


def test_block_ops_address_past_2g_elements():
    """A storage of more than 2^31 elements (4.3 GB of fp16, Llama-3-70B TP2 layers): the
    highest blocks are copied and exchanged correctly (64-bit offsets)."""
    s = shape_of("llama-3-70b-tp2")
    bs = 16
    per_block = s.layers * 2 * bs * s.kv_heads * s.head_dim
    nb = SIZES.blocks if TINY else (1 << 31) // per_block + 64
    assert TINY or nb * per_block > 1 << 31
    st = _storage(s, torch.float16, bs, nb)
    want = st.gpu.clone()
    top = [nb - 1, nb - 2, nb - 3, nb - 4]
    copy_pairs = torch.tensor([[top[0], 1], [2, top[1]], [top[2], 3]], device=DEVICE)
    copy_blocks(st.gpu, st.gpu, copy_pairs)
    copy_blocks_ref(want, want, copy_pairs)
    assert torch.equal(st.gpu, want)
    ex_pairs = torch.tensor([[top[3], 5], [top[0], 6]], device=DEVICE)
    exchange_blocks(st.gpu, ex_pairs)
    exchange_blocks_ref(want, ex_pairs)
    assert torch.equal(st.gpu, want)
