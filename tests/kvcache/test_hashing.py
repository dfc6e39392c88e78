"""Block keys: hashing many prompts in one batch gives what hashing each alone gives."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsim.kvcache.hashing import block_keys, prefix_keys, root_state, unique_keys
from kvsim.kvcache.sequence import Sequence

prompts = st.lists(st.lists(st.integers(0, 2**31 - 1), max_size=80), max_size=6)


@settings(max_examples=200, deadline=None)
@given(prompts, st.sampled_from([1, 2, 4, 16]), st.integers(0, 3))
def test_a_batch_hashes_each_prompt_as_alone(batch: list[list[int]], bs: int, extra: int) -> None:
    arrays = [np.array(p, dtype=np.int32) for p in batch]
    got = prefix_keys(arrays, bs, extra)
    assert len(got) == len(arrays)
    for p, (keys, state) in zip(arrays, got, strict=True):
        alone = Sequence("s", p, extra_key=extra)
        assert keys == alone.hashes_upto(len(p) // bs * bs, bs) == block_keys(p, bs, extra)
        assert state == alone._state  # the chain goes on from there through known output
        # one prompt takes the plain chain (kvcache/hashing.py `prefix_keys`), a batch the closed form
        assert prefix_keys([p], bs, extra) == [(keys, state)]


def test_a_sequence_given_its_keys_hashes_on_as_one_that_hashed_them() -> None:
    prompt, output = np.arange(37, dtype=np.int32), np.arange(500, 540, dtype=np.int32)
    [keys] = prefix_keys([prompt], 4)
    assert len(keys[0]) == 9 and prefix_keys([prompt[:3]], 4) == [([], root_state())]
    given_keys = Sequence("a", prompt, uid=7, output=output, keys=keys)
    hashed = Sequence("a", prompt, uid=7, output=output)
    given_keys.num_tokens = hashed.num_tokens = 37 + 60  # past the known output: unique decoded tokens
    assert given_keys.hashes_upto(97, 4) == hashed.hashes_upto(97, 4)
    assert len(hashed.block_hashes) == 24


def test_blocks_past_the_known_tokens_get_distinct_unique_keys() -> None:
    """A block holding a unique decoded token matches no other block, so its key is only made
    distinct: (uid, block index) through an invertible mix, not a hash of the prefix."""
    seq = Sequence("a", np.arange(10, dtype=np.int32), uid=3, output=np.arange(90, 96, dtype=np.int32))
    seq.num_tokens = 24  # known: 10 prompt and 6 output tokens, 4 full blocks of 4
    keys = seq.hashes_upto(24, 4)
    assert keys[:4] == block_keys(np.concatenate([seq.prompt, seq.output]), 4)
    assert keys[4:] == unique_keys(3, 4, 6) == [0xE05963C978C0A027, 0xB18D8917D4E2E57B]
    grid = [k for uid in range(64) for k in unique_keys(uid, 0, 256)]
    assert len(set(grid)) == len(grid) and all(0 <= k < 1 << 64 for k in grid)
    assert len({k & 0xFFFF for k in grid}) > 14_000  # low bits spread like random ones (about 14,500): dict slots do not pile up
