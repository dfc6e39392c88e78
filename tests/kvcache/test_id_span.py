"""IdSpan: the used-id span the pool reports to when no defragmenter runs."""

from __future__ import annotations

import numpy as np

from kvsim.kvcache.block import KVCacheBlock
from kvsim.kvcache.id_span import IdSpan
from kvsim.kvcache.manager import KVCacheManager
from kvsim.kvcache.sequence import Sequence


def test_span_follows_uses_and_releases() -> None:
    blocks = [KVCacheBlock(i) for i in range(10)]
    span = IdSpan(blocks)
    assert span.fragmentation() == 0 and span.max_used() == 0

    def use(*ids: int) -> None:
        for i in ids:
            blocks[i].ref_cnt = 1
        span.use_distinct(list(ids))

    def release(*ids: int) -> None:
        for i in ids:
            blocks[i].ref_cnt = 0
        span.release_distinct(list(ids))

    use(2, 7)
    assert (span.num_used(), span.max_used(), span.fragmentation()) == (2, 7, 5)
    use(9)
    release(9, 2)  # the top goes: the next used id below it is found on demand
    assert (span.num_used(), span.max_used(), span.fragmentation()) == (1, 7, 6)
    release(7)
    assert (span.num_used(), span.max_used(), span.fragmentation()) == (0, 0, 0)


def test_manager_reports_the_span_without_a_defragmenter() -> None:
    m = KVCacheManager(9, 4)
    a, b = Sequence("a", np.arange(8)), Sequence("b", np.arange(100, 112))
    m.allocate_slots(a, 8)
    m.allocate_slots(b, 12)  # ids 1-2 for a, 3-5 for b (LRU order)
    assert m.defrag is None and m.id_space_fragmentation() == 0
    m.free(a)
    assert m.id_space_fragmentation() == 5 - 3
