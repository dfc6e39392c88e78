import numpy as np
import pytest

from kvsim.kvcache.manager import KVCacheManager
from kvsim.kvcache.sequence import Sequence


def seq(sid: str, tokens, uid: int = 0, output=None) -> Sequence:
    return Sequence(sid, np.asarray(tokens, dtype=np.int32), uid=uid,
                    output=None if output is None else np.asarray(output, dtype=np.int32))


def prefill(m: KVCacheManager, s: Sequence):
    """Look up, allocate and compute a sequence's whole context; sample one token."""
    blocks, hit = m.get_computed_blocks(s)
    new = m.allocate_slots(s, s.num_tokens - hit, hit, blocks)
    assert new is not None
    s.num_computed_tokens = s.num_tokens
    s.append_tokens(1)
    return hit, new


def decode(m: KVCacheManager, s: Sequence):
    new = m.allocate_slots(s, 1)
    if new is not None:
        s.num_computed_tokens += 1
        s.append_tokens(1)
    return new


@pytest.fixture
def lru():
    return KVCacheManager(10, 4, record_ops=True)
