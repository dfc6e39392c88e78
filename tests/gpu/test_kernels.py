"""Each Triton kernel against its plain-torch reference (bit-equal for data movement)."""

import pytest
import torch
from gpu_env import DEVICE, HAS_CUDA

from kvsim.gpu.kernels import (
    copy_blocks,
    decode_attention,
    exchange_blocks,
    swap_blocks,
    write_kv,
    write_kv_layers,
)
from kvsim.gpu.reference import (
    copy_blocks_ref,
    decode_attention_ref,
    dense_attention,
    exchange_blocks_ref,
    gather_context,
    write_kv_ref,
)
from kvsim.gpu.storage import PagedKVStorage

L, NB, BS, H, D = 2, 6, 4, 2, 8


def filled(shape, dtype=torch.float32, device=DEVICE, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_kv_matches_reference_and_skips_padding(dtype):
    qkv = filled((5, 3, H, D), dtype)  # key/value are strided views, as after a qkv split
    key, value = qkv[:, 1], qkv[:, 2]
    slots = torch.tensor([0, 7, -1, 13, 23], device=DEVICE)
    caches = [torch.zeros((NB, BS, H, D), dtype=dtype, device=DEVICE) for _ in range(4)]
    write_kv(key, value, caches[0], caches[1], slots)
    write_kv_ref(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert torch.equal(caches[0][1, 3], key[1]) and torch.equal(caches[1][5, 3], value[4])
    assert int((caches[0] != 0).flatten(1).any(1).sum()) == 4  # the -1 slot wrote nothing


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_kv_layers_is_write_kv_on_every_layer_in_one_launch(dtype):
    """write_kv_layers: each layer's K and V as write_kv puts them, the storage's own layout, -1 skipped."""
    vals = filled((5, L, 2, H, D), dtype, seed=3)
    slots = torch.tensor([0, 7, -1, 13, 23], device=DEVICE)
    fused = PagedKVStorage(L, NB, BS, H, D, dtype=dtype, device=DEVICE)
    per_layer = PagedKVStorage(L, NB, BS, H, D, dtype=dtype, device=DEVICE)
    write_kv_layers(vals, fused.gpu, slots)
    for layer in range(L):
        write_kv(vals[:, layer, 0], vals[:, layer, 1], per_layer.key(layer), per_layer.value(layer), slots)
    assert torch.equal(fused.gpu, per_layer.gpu)
    assert torch.equal(fused.value(L - 1)[13 // BS, 13 % BS], vals[3, L - 1, 1])
    assert int((fused.gpu != 0).flatten(3).any(3).sum()) == 4 * L * 2  # four slots a layer and plane
    with pytest.raises(ValueError, match="disagree"):
        write_kv_layers(vals[:, :, :1], fused.gpu, slots)
    write_kv_layers(vals[:0], fused.gpu, slots[:0])  # nothing to write


def test_storage_layout_slot_is_block_times_size_plus_offset():
    st = PagedKVStorage(L, NB, BS, H, D, num_cpu_blocks=2, dtype=torch.float32, device=DEVICE)
    st.gpu.copy_(filled(st.gpu.shape))
    assert st.key(1).shape == (NB, BS, H, D) and st.cpu_value(0).shape == (2, BS, H, D)
    assert torch.equal(st.slots()[1, 0, 3 * BS + 2], st.key(1)[3, 2])
    assert torch.equal(st.slots()[0, 1, 5 * BS + 1], st.value(0)[5, 1])
    assert st.block_bytes == 2 * L * BS * H * D * 4


def test_copy_blocks_matches_reference():
    cache = filled((L, 2, NB, BS, H, D))
    want = cache.clone()
    pairs = torch.tensor([[1, 4], [2, 5], [1, 3]], device=DEVICE)
    copy_blocks(cache, cache, pairs)
    copy_blocks_ref(want, want, pairs)
    assert torch.equal(cache, want)
    assert torch.equal(cache[:, :, 3], cache[:, :, 1]) and not torch.equal(cache[:, :, 0], cache[:, :, 1])


@pytest.mark.parametrize("method", ["kernel", "torch"])
def test_swap_blocks_out_and_back(method):
    gpu = filled((L, 2, NB, BS, H, D))
    cpu = torch.zeros((L, 2, 3, BS, H, D), pin_memory=HAS_CUDA)
    out_pairs = torch.tensor([[4, 0], [2, 2]], device=DEVICE)
    swap_blocks(gpu, cpu, out_pairs, method)
    want = torch.zeros_like(cpu)
    copy_blocks_ref(gpu, want, out_pairs.cpu())
    assert torch.equal(cpu, want) and torch.equal(cpu[:, :, 0], gpu[:, :, 4].cpu())
    back = gpu.clone()
    swap_blocks(cpu, back, torch.tensor([[0, 1], [2, 5]]), method)
    ref = gpu.clone()
    copy_blocks_ref(cpu, ref, torch.tensor([[0, 1], [2, 5]]))
    assert torch.equal(back, ref) and torch.equal(back[:, :, 1], gpu[:, :, 4])


def test_swap_rejects_unknown_method():
    with pytest.raises(ValueError, match="unknown swap method 'dma'"):
        swap_blocks(filled((1, 2, 2, BS, H, D)), torch.zeros((1, 2, 2, BS, H, D)),
                    torch.tensor([[0, 1]]), "dma")


def test_exchange_blocks_swaps_contents():
    cache = filled((L, 2, NB, BS, H, D))
    before = cache.clone()
    want = cache.clone()
    pairs = torch.tensor([[5, 1], [4, 2]], device=DEVICE)
    exchange_blocks(cache, pairs)
    exchange_blocks_ref(want, pairs)
    assert torch.equal(cache, want)
    assert torch.equal(cache[:, :, 1], before[:, :, 5]) and torch.equal(cache[:, :, 5], before[:, :, 1])
    assert torch.equal(cache[:, :, 3], before[:, :, 3])


def _paged_batch(dtype, ctx, num_heads=4, kv_heads=2, head_dim=16, bs=4, seed=1):
    """Random K/V in shuffled physical blocks, and each sequence's table."""
    pages = [-(-n // bs) for n in ctx]
    nb = 1 + sum(pages)
    kc = filled((nb, bs, kv_heads, head_dim), dtype, seed=seed)
    vc = filled((nb, bs, kv_heads, head_dim), dtype, seed=seed + 1)
    perm = (torch.randperm(nb - 1, generator=torch.Generator().manual_seed(seed)) + 1).tolist()
    tables = torch.zeros((len(ctx), max(pages)), dtype=torch.int32)
    for b, p in enumerate(pages):
        tables[b, :p] = torch.tensor(perm[:p], dtype=torch.int32)
        perm = perm[p:]
    q = filled((len(ctx), num_heads, head_dim), dtype, seed=seed + 2)
    return q, kc, vc, tables.to(DEVICE), torch.tensor(ctx, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("window", [None, 7])
def test_decode_attention_matches_reference(splits, window):
    q, kc, vc, tables, ctx = _paged_batch(torch.float32, [37, 1, 16, 50])
    out = decode_attention(q, kc, vc, tables, ctx, sliding_window=window, num_splits=splits, block_n=16)
    ref = decode_attention_ref(q, kc, vc, tables, ctx, sliding_window=window)
    assert out.shape == (4, 4, 16)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_decode_attention_matches_sdpa_fp16_gqa():
    q, kc, vc, tables, ctx = _paged_batch(torch.float16, [29, 70], num_heads=8, kv_heads=2)
    out = decode_attention(q, kc, vc, tables, ctx, num_splits=2, block_n=16)
    for b, n in enumerate(ctx.tolist()):
        k = gather_context(kc, tables[b], 0, n).float().repeat_interleave(4, dim=1).transpose(0, 1)
        v = gather_context(vc, tables[b], 0, n).float().repeat_interleave(4, dim=1).transpose(0, 1)
        sdpa = torch.nn.functional.scaled_dot_product_attention(q[b].float()[:, None], k, v)[:, 0]
        torch.testing.assert_close(out[b].float(), sdpa, atol=5e-3, rtol=5e-3)
        dense = dense_attention(q[b], gather_context(kc, tables[b], 0, n), gather_context(vc, tables[b], 0, n))
        torch.testing.assert_close(out[b].double(), dense, atol=5e-3, rtol=5e-3)


def test_decode_attention_rejects_bad_group():
    q, kc, vc, tables, ctx = _paged_batch(torch.float32, [5], num_heads=3, kv_heads=2)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        decode_attention(q, kc, vc, tables, ctx)


@pytest.mark.cuda
def test_decode_attention_long_context_on_cuda():
    q, kc, vc, tables, ctx = _paged_batch(torch.float16, [4096, 1000, 33], num_heads=32, kv_heads=8,
                                          head_dim=128, bs=16)
    out = decode_attention(q, kc, vc, tables, ctx)
    ref = decode_attention_ref(q, kc, vc, tables, ctx)
    torch.testing.assert_close(out, ref, atol=5e-3, rtol=5e-3)


def test_count_wrong_counts_exactly_the_values_that_differ_from_their_keys():
    import numpy as np

    from kvsim.gpu.kernels import count_wrong
    from kvsim.gpu.values import DeviceValues, device_keys, prefix_keys

    dv = DeviceValues(2, H, 2 * H, D, torch.device(DEVICE), torch.float16)
    keys = device_keys(prefix_keys(np.arange(40) % 13), torch.device(DEVICE))
    planes = torch.zeros((2 * 2, 64, H * D), dtype=torch.float16, device=DEVICE)
    slots = torch.randperm(64, generator=torch.Generator().manual_seed(1))[:40].to(DEVICE)
    planes[:, slots] = dv.kv(keys).reshape(40, 4, H * D).permute(1, 0, 2)
    assert int(count_wrong(planes, slots, keys, dv.kv_salts).sum()) == 0
    planes[3, slots[7], 5] += 0.25
    planes[0, slots[39], :3] = 9.0
    wrong = count_wrong(planes, slots, keys, dv.kv_salts)
    assert wrong.nonzero().tolist() == [[0, 39], [3, 7]] and wrong[0, 39] == 3
