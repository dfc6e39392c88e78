"""The replayer's block tables and the op batching that preserves stream order."""

import numpy as np
import pytest
import torch
from gpu_env import DEVICE

from kvsim.gpu.backends import BACKENDS, backend
from kvsim.gpu.executor import OpExecutor
from kvsim.gpu.storage import PagedKVStorage
from kvsim.gpu.tables import BlockTables
from kvsim.gpu.timing import Timer
from kvsim.gpu.values import DeviceValues, kv_values, prefix_keys


def test_table_ops_moves_and_frees():
    t = BlockTables()
    for i, b in enumerate([3, 5, 7]):
        t.set("a", i, b)
    t.set("b", 0, 3)
    t.set("b", 1, 9)
    t.exchange(9, 2)
    t.exchange(3, 4)
    assert t.rows == {"a": [4, 5, 7], "b": [4, 2]}
    assert t.free(5) == ["a"]
    assert t.rows == {"b": [4, 2]} and t.holders[4] == {"b"}
    t.set("b", 3, 0)  # a sliding-window hole, and entry 2 never set
    pos, blocks, missing = t.slots("b", 14, 4)
    assert pos.tolist() == list(range(8)) and blocks.tolist() == [4] * 4 + [2] * 4 and missing == 8


def test_null_entries_are_skipped():
    t = BlockTables()
    for i, b in enumerate([0, 0, 6]):
        t.set("w", i, b)
    pos, blocks, missing = t.slots("w", 10, 4)
    assert pos.tolist() == [8, 9] and blocks.tolist() == [6, 6] and missing == -1


def _executor(kernels, blocks=8, cpu=4):
    st = PagedKVStorage(1, blocks, 2, 1, 4, num_cpu_blocks=cpu, dtype=torch.float32, device=DEVICE)
    values = DeviceValues(st.num_layers, st.num_kv_heads, st.num_kv_heads, st.head_dim, st.device, st.dtype)
    return st, OpExecutor(st, Timer(st.device), values, backend(kernels, st.device))


def _block(st, b):
    return st.gpu[0, 0, b].flatten().tolist()


@pytest.mark.parametrize("kernels", BACKENDS)
def test_dependent_ops_of_one_kind_run_in_order(kernels):
    st, ex = _executor(kernels)
    keys = prefix_keys(np.array([5, 6]))
    ex.write(np.array([2, 3]), keys)  # block 1
    ex.pair("copy", 1, 2)
    ex.pair("copy", 2, 3)  # reads the previous copy's dst: a new batch
    ex.pair("copy", 1, 4)
    ex.pair("move", 4, 5)
    ex.pair("move", 5, 6)  # touches the previous move's block: a new batch
    ex.flush()
    want = kv_values(keys, 1, 1, 4)[:, 0, 0].flatten().tolist()
    assert _block(st, 1) == want and _block(st, 2) == want and _block(st, 3) == want
    assert _block(st, 6) == want and _block(st, 4) == [0.0] * 8 and _block(st, 5) == [0.0] * 8
    assert ex.launches == 1 + 2 + 2  # write, two copy batches, two move batches


@pytest.mark.parametrize("kernels", BACKENDS)
def test_rewritten_slot_keeps_the_later_value(kernels):
    st, ex = _executor(kernels)
    ex.write(np.array([6]), prefix_keys(np.array([1])))
    ex.write(np.array([6]), prefix_keys(np.array([2])))
    ex.flush()
    assert _block(st, 3)[:4] == kv_values(prefix_keys(np.array([2])), 1, 1, 4)[0, 0, 0, 0].tolist()
    assert ex.launches == 2


@pytest.mark.parametrize("kernels", BACKENDS)
def test_swap_out_then_in_round_trips(kernels):
    st, ex = _executor(kernels)
    ex.write(np.array([2, 3, 4]), prefix_keys(np.array([1, 2, 3])))
    ex.pair("swap_out", 1, 3)
    ex.pair("swap_out", 2, 0)
    ex.pair("swap_in", 3, 6)
    ex.pair("swap_in", 0, 7)
    ex.flush()
    assert torch.equal(st.gpu[:, :, 6], st.gpu[:, :, 1]) and torch.equal(st.gpu[:, :, 7], st.gpu[:, :, 2])
    assert torch.equal(st.cpu[:, :, 3], st.gpu[:, :, 1].cpu())
