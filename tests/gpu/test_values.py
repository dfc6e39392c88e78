"""Expected K/V: prefix functions, exact in every storage dtype."""

import numpy as np
import torch

from kvsim.gpu.values import kv_values, prefix_keys, query_values


def test_keys_are_equal_exactly_on_shared_prefixes():
    a = prefix_keys(np.array([1, 2, 3, 4, 5]))
    b = prefix_keys(np.array([1, 2, 3, 9, 5]))
    assert (a == b).tolist() == [True, True, True, False, False]
    assert prefix_keys(np.array([1, 2]))[1] == a[1]  # a key depends on nothing after it
    assert a.dtype == np.uint64 and len(set(a.tolist())) == 5


def test_keys_take_the_negative_ids_of_decoded_tokens():
    k = prefix_keys(np.array([7, -(1 + (3 << 24 | 1))]))
    assert k[1] != prefix_keys(np.array([7, -(1 + (4 << 24 | 1))]))[1]


def test_values_are_quarters_exact_in_half_precision():
    v = kv_values(prefix_keys(np.arange(40)), 2, 3, 8)
    assert v.shape == (40, 2, 2, 3, 8) and v.dtype == np.float32
    assert sorted(np.unique(v).tolist()) == [-1.0, -0.75, -0.5, -0.25, 0.0, 0.25, 0.5, 0.75]
    t = torch.from_numpy(v)
    for dtype in (torch.float16, torch.bfloat16):
        assert torch.equal(t.to(dtype).float(), t)


def test_values_differ_for_a_different_prefix_and_between_k_v_and_q():
    keys = prefix_keys(np.array([1, 2, 3]))
    other = prefix_keys(np.array([1, 5, 3]))
    v, w = kv_values(keys, 1, 2, 16), kv_values(other, 1, 2, 16)
    assert np.array_equal(v[0], w[0])
    assert (v[1] != w[1]).mean() > 0.7 and (v[2] != w[2]).mean() > 0.7
    assert not np.array_equal(v[:, :, 0], v[:, :, 1])
    q = query_values(keys, 1, 2, 16)
    assert q.shape == (3, 1, 2, 16) and not np.array_equal(q[:, 0], v[:, 0, 0])


def test_device_values_equal_the_numpy_ones_bit_for_bit():
    from kvsim.gpu.values import DeviceValues, device_keys

    keys = prefix_keys(np.arange(300) * 7919 % 5003)
    dv = DeviceValues(3, 2, 4, 16, torch.device("cpu"), torch.float32)
    t = device_keys(keys, torch.device("cpu"))
    want = kv_values(keys, 3, 2, 16)
    assert np.array_equal(dv.kv(t).numpy(), want)
    assert np.array_equal(dv.kv(t, layer=2).numpy(), want[:, 2])
    assert np.array_equal(dv.kv(t, dtype=torch.bfloat16).float().numpy(), want)
    assert np.array_equal(dv.query(t).numpy(), query_values(keys, 3, 4, 16))
