"""`KVCacheManager.decode_in_place` with op records: one call for a quiet step's decodes (its new
blocks taken in one go) records the very rows, blocks and evictions of a `decode_slot` each
(vllm/v1/core/kv_cache_manager.py `allocate_slots`, one token a running request, in RUNNING order;
vllm/v1/core/block_pool.py `get_new_blocks` evicting a popped cached block)."""

from __future__ import annotations

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvsim.kvcache.manager import KVCacheManager
from tests.kvcache.conftest import prefill, seq

BS = 4


def _manager(policy: str, events: bool, cached: int, lengths: list[int], slack: int) -> tuple[KVCacheManager, list]:
    """A pool whose free queue holds `cached` freed, cached prompts of 2 blocks, and running
    sequences of `lengths` prompt tokens (one sampled: their decode is at slot length % BS), with
    `slack` uncached free blocks (few: the decodes' new blocks evict cached ones)."""
    need = 1 + 2 * cached + sum(-(-n // BS) for n in lengths)  # the null block, the prompts' blocks
    m = KVCacheManager(need + slack, BS, eviction=policy, kv_events=events, record_ops=True)
    for i in range(cached):
        done = seq(f"done{i}", range(1000 * (i + 1), 1000 * (i + 1) + 2 * BS))
        prefill(m, done)
        m.free(done)
    running = []
    for i, n in enumerate(lengths):
        s = seq(f"r{i}", range(100_000 * (i + 1), 100_000 * (i + 1) + n))
        prefill(m, s)
        running.append(s)
    m.ops.step = 7
    return m, running


@settings(max_examples=150, deadline=None)
@given(policy=st.sampled_from(["lru", "fifo", "arc"]), events=st.booleans(), cached=st.integers(0, 6),
       lengths=st.lists(st.integers(1, 3 * BS), min_size=1, max_size=5), slack=st.integers(0, 3))
def test_one_call_records_what_a_decode_slot_each_records(policy: str, events: bool, cached: int,
                                                           lengths: list[int], slack: int) -> None:
    assume(sum(n % BS == 0 for n in lengths) <= 2 * cached + slack)  # the new blocks there are
    each, seqs_each = _manager(policy, events, cached, lengths, slack)
    once, seqs_once = _manager(policy, events, cached, lengths, slack)
    for s in seqs_each:
        assert each.decode_slot(s) is not False
    new = sum(s.num_computed_tokens // BS == len(once.block_ids(s.seq_id)) for s in seqs_once)
    once.decode_in_place(seqs_once, new if policy == "lru" else 0)
    assert once.ops.records() == each.ops.records()
    assert dict(once.ops.counts) == dict(each.ops.counts)
    assert [once.block_ids(s.seq_id) for s in seqs_once] == [each.block_ids(s.seq_id) for s in seqs_each]
    assert once.pool.num_evictions == each.pool.num_evictions
    assert once.pool.num_free_blocks == each.pool.num_free_blocks
    if events:
        assert once.events.queue == each.events.queue


def test_a_step_s_evictions_stay_with_the_block_that_takes_them() -> None:
    """Three sequences at a block's first slot over a queue of cached free blocks: each row of the
    one take's evictions comes right before the table entry and write of the sequence it serves."""
    m, running = _manager("lru", False, 2, [BS, 2 * BS, BS + 1], 0)
    free_before = m.pool.num_free_blocks
    m.decode_in_place(running, 2)  # r0 and r1 start a block; r2 writes slot 1 of its second
    kinds = [(op.kind, op.seq) for op in m.ops.records() if op.step == 7]
    assert kinds == [("evict", ""), ("table", "r0"), ("write", "r0"),
                     ("evict", ""), ("table", "r1"), ("write", "r1"),
                     ("write", "r2")]
    evicts = [op for op in m.ops.records() if op.kind == "evict"]
    assert [op.a for op in evicts] == m.block_ids("r0")[-1:] + m.block_ids("r1")[-1:]
    assert m.pool.num_free_blocks == free_before - 2
