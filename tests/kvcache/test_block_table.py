"""BlockTable: rows, kernel split, slot mapping (plain and context parallel), remap, errors."""

import numpy as np
import pytest

from kvsim.kvcache.block_table import BlockTable


def _arr(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def test_rows_and_plain_slot_mapping():
    bt = BlockTable(block_size=4, max_num_reqs=3, max_num_blocks_per_req=4, max_num_batched_tokens=32)
    bt.add_row([5, 2], 0)
    bt.add_row([7], 1)
    assert bt.row(0).tolist() == [5, 2]
    assert bt.num_blocks_per_row.tolist() == [2, 1, 0]
    assert bt.table[:2].tolist() == [[5, 2, 0, 0], [7, 0, 0, 0]]
    assert bt.table.dtype == np.int32

    slots = bt.compute_slot_mapping(_arr(0, 0, 0, 0, 0, 1, 1), _arr(0, 3, 4, 7, 5, 0, 3))
    assert slots.dtype == np.int64
    assert slots.tolist() == [20, 23, 8, 11, 9, 28, 31]

    bt.append_row([9], 0)
    assert bt.row(0).tolist() == [5, 2, 9]
    assert bt.compute_slot_mapping(_arr(0, 0), _arr(8, 11)).tolist() == [36, 39]
    bt.append_row([], 0)
    assert bt.row(0).tolist() == [5, 2, 9]


def test_add_row_replaces_and_clear_row_zeroes():
    bt = BlockTable(4, 2, 4, 16)
    bt.add_row([1, 2, 3], 0)
    bt.add_row([8], 0)
    assert bt.table[0].tolist() == [8, 0, 0, 0]
    bt.clear_row(0)
    assert bt.num_blocks_per_row[0] == 0
    assert bt.table[0].tolist() == [0, 0, 0, 0]
    assert bt.row(0).tolist() == []


def test_kernel_split_expands_block_ids():
    bt = BlockTable(32, 2, 4, 64, kernel_block_size=16)
    bt.add_row([3, 7], 0)
    assert bt.block_size == 16 and bt.blocks_per_alloc_block == 2
    assert bt.row(0).tolist() == [3, 7]
    assert bt.num_blocks_per_row[0] == 2
    assert bt.num_kernel_blocks_per_row[0] == 4
    assert bt.table[0].tolist() == [6, 7, 14, 15, 0, 0, 0, 0]
    # kernel slot numbering equals allocation slot numbering: 3*32 + p and 7*32 + (p - 32)
    slots = bt.compute_slot_mapping(np.zeros(6, dtype=np.int64), _arr(0, 15, 16, 31, 32, 63))
    assert slots.tolist() == [96, 111, 112, 127, 224, 255]
    bt.append_row([1], 0)
    assert bt.table[0].tolist() == [6, 7, 14, 15, 2, 3, 0, 0]
    assert bt.compute_slot_mapping(_arr(0), _arr(80)).tolist() == [48]


def test_kernel_block_size_must_divide_block_size():
    with pytest.raises(ValueError, match="kernel_block_size 12 .* block_size 32"):
        BlockTable(32, 2, 4, 64, kernel_block_size=12)


def _cp_slots(rank: int, interleave: int) -> list[int]:
    bt = BlockTable(4, 1, 2, 16, cp_world_size=2, cp_rank=rank, cp_interleave=interleave)
    bt.add_row([5, 9], 0)
    return bt.compute_slot_mapping(np.zeros(16, dtype=np.int64), np.arange(16)).tolist()


def _assert_ranks_partition(per_rank: list[list[int]]) -> None:
    owners = np.array([[s != -1 for s in slots] for slots in per_rank])
    assert owners.sum(axis=0).tolist() == [1] * owners.shape[1]
    for slots in per_rank:
        local = [s for s in slots if s != -1]
        assert len(local) == len(set(local))


def test_cp_interleave_1():
    rank0, rank1 = _cp_slots(0, 1), _cp_slots(1, 1)
    # virtual block = 4 * 2 tokens; even offsets on rank 0, odd on rank 1
    assert rank0 == [20, -1, 21, -1, 22, -1, 23, -1, 36, -1, 37, -1, 38, -1, 39, -1]
    assert rank1 == [-1, 20, -1, 21, -1, 22, -1, 23, -1, 36, -1, 37, -1, 38, -1, 39]
    _assert_ranks_partition([rank0, rank1])


def test_cp_interleave_2():
    rank0, rank1 = _cp_slots(0, 2), _cp_slots(1, 2)
    # pairs of tokens alternate ranks: offsets 0,1 | 2,3 | 4,5 | 6,7 -> r0, r1, r0, r1
    assert rank0 == [20, 21, -1, -1, 22, 23, -1, -1, 36, 37, -1, -1, 38, 39, -1, -1]
    assert rank1 == [-1, -1, 20, 21, -1, -1, 22, 23, -1, -1, 36, 37, -1, -1, 38, 39]
    _assert_ranks_partition([rank0, rank1])


def test_cp_with_kernel_split():
    per_rank = []
    for rank in (0, 1):
        bt = BlockTable(8, 1, 1, 16, kernel_block_size=4, cp_world_size=2, cp_rank=rank)
        bt.add_row([5], 0)  # kernel blocks 10, 11
        per_rank.append(bt.compute_slot_mapping(np.zeros(16, dtype=np.int64), np.arange(16)).tolist())
    assert per_rank[0] == [40, -1, 41, -1, 42, -1, 43, -1, 44, -1, 45, -1, 46, -1, 47, -1]
    assert per_rank[1] == [-1, 40, -1, 41, -1, 42, -1, 43, -1, 44, -1, 45, -1, 46, -1, 47]
    _assert_ranks_partition(per_rank)


def test_cp_capacity_is_blocks_times_world_size():
    bt = BlockTable(4, 1, 2, 16, cp_world_size=2, cp_rank=0)
    bt.add_row([5, 9], 0)
    assert bt.compute_slot_mapping(_arr(0), _arr(15)).tolist() == [-1]
    with pytest.raises(ValueError, match="position 16 of row 0 .* 2 blocks \\(16 tokens\\)"):
        bt.compute_slot_mapping(_arr(0), _arr(16))


def test_move_and_swap_rows():
    bt = BlockTable(4, 3, 4, 16)
    bt.add_row([1, 2, 3], 0)
    bt.add_row([4], 1)
    bt.move_row(0, 2)
    assert bt.row(2).tolist() == [1, 2, 3]
    assert bt.row(0).tolist() == [1, 2, 3]
    bt.swap_row(0, 1)
    assert bt.num_blocks_per_row.tolist() == [1, 3, 3]
    assert bt.table.tolist() == [[4, 0, 0, 0], [1, 2, 3, 0], [1, 2, 3, 0]]
    bt.move_row(0, 2)  # a shorter row over a longer one leaves no stale tail
    assert bt.table[2].tolist() == [4, 0, 0, 0]
    assert bt.compute_slot_mapping(_arr(1, 2), _arr(9, 1)).tolist() == [13, 17]


def test_move_and_swap_rows_with_kernel_split():
    bt = BlockTable(32, 2, 2, 64, kernel_block_size=16)
    bt.add_row([3, 7], 0)
    bt.add_row([1], 1)
    bt.swap_row(0, 1)
    assert bt.row(0).tolist() == [1] and bt.row(1).tolist() == [3, 7]
    assert bt.table.tolist() == [[2, 3, 0, 0], [6, 7, 14, 15]]
    bt.move_row(1, 0)
    assert bt.table.tolist() == [[6, 7, 14, 15], [6, 7, 14, 15]]
    assert bt.num_blocks_per_row.tolist() == [2, 2]


def test_remap_rewrites_valid_entries_only():
    bt = BlockTable(4, 3, 3, 16)
    bt.add_row([3, 7], 0)
    bt.add_row([7, 1], 1)
    mapping = np.arange(10)
    mapping[[3, 1, 7, 2, 0]] = [1, 3, 2, 7, 9]  # 0 -> 9 shows padding is left alone
    bt.remap(mapping)
    assert bt.table.tolist() == [[1, 2, 0], [2, 3, 0], [0, 0, 0]]
    assert bt.compute_slot_mapping(_arr(0, 1), _arr(5, 0)).tolist() == [9, 8]


def test_remap_with_kernel_split_maps_allocation_ids():
    bt = BlockTable(32, 2, 3, 64, kernel_block_size=16)
    bt.add_row([3, 7], 0)
    bt.add_row([2], 1)
    mapping = np.arange(8)
    mapping[[3, 1, 7, 2]] = [1, 3, 2, 7]
    bt.remap(mapping)
    assert bt.row(0).tolist() == [1, 2] and bt.row(1).tolist() == [7]
    assert bt.table.tolist() == [[2, 3, 4, 5, 0, 0], [14, 15, 0, 0, 0, 0]]
    assert bt.compute_slot_mapping(_arr(0, 0, 1), _arr(0, 40, 17)).tolist() == [32, 72, 241]


def test_remap_errors():
    bt = BlockTable(4, 1, 2, 16)
    bt.add_row([3, 7], 0)
    with pytest.raises(ValueError, match="block id 7 is outside mapping of size 5"):
        bt.remap(np.arange(5))
    with pytest.raises(ValueError, match="1-D integer"):
        bt.remap(np.zeros((2, 8), dtype=np.int64))
    assert bt.row(0).tolist() == [3, 7]


def test_row_errors():
    bt = BlockTable(4, 2, 2, 8)
    with pytest.raises(IndexError, match="row 2 out of range"):
        bt.append_row([1], 2)
    with pytest.raises(IndexError, match="row -1 out of range"):
        bt.swap_row(0, -1)
    bt.add_row([1, 2], 0)
    with pytest.raises(ValueError, match="row 0 holds 2 blocks; appending 1 exceeds max_num_blocks_per_req 2"):
        bt.append_row([3], 0)
    with pytest.raises(ValueError, match="negative block id -4"):
        bt.append_row([-4], 1)


def test_slot_mapping_errors():
    bt = BlockTable(4, 2, 2, 8)
    bt.add_row([1, 2], 0)
    bt.add_row([3], 1)
    with pytest.raises(IndexError, match="row 5 out of range"):
        bt.compute_slot_mapping(_arr(0, 5), _arr(0, 0))
    with pytest.raises(ValueError, match="position 4 of row 1 is outside its 1 blocks \\(4 tokens\\)"):
        bt.compute_slot_mapping(_arr(0, 1), _arr(7, 4))
    with pytest.raises(ValueError, match="position -1 of row 0"):
        bt.compute_slot_mapping(_arr(0), _arr(-1))
    with pytest.raises(ValueError, match="differ in shape"):
        bt.compute_slot_mapping(_arr(0, 0), _arr(0))
    with pytest.raises(ValueError, match="9 tokens exceed max_num_batched_tokens 8"):
        bt.compute_slot_mapping(np.zeros(9, dtype=np.int64), np.zeros(9, dtype=np.int64))
    assert bt.compute_slot_mapping(_arr(), _arr()).tolist() == []


def test_cp_argument_errors():
    with pytest.raises(ValueError, match="cp_rank 2 not in"):
        BlockTable(4, 1, 1, 4, cp_world_size=2, cp_rank=2)
    with pytest.raises(ValueError, match="cp_interleave 3 must be positive and divide the kernel block size 4"):
        BlockTable(4, 1, 1, 4, cp_world_size=2, cp_interleave=3)
