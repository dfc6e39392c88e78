"""Block keys: hashing many prompts in one batch gives what hashing each alone gives."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsim.kvcache import hashing
from kvsim.kvcache.hashing import block_keys, few_keys, prefix_keys, root_state, unique_keys
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


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=200), st.sampled_from([1, 3, 16, 64]),
       st.integers(0, 2**64 - 1), st.sampled_from([np.int32, np.int64]))
def test_few_keys_are_the_vector_paths_keys(tokens: list[int], bs: int, state: int, dtype) -> None:
    """`few_keys` (plain ints, for a block or two) gives the keys and the last raw state of
    `keys(chain(state, content_hashes(...)))`, for any tokens (negative ones wrap as numpy's uint64
    cast wraps them), block size and chain state."""
    t = np.array(tokens, dtype=dtype)
    states = hashing.chain(state, hashing.content_hashes(t, bs))
    assert few_keys(state, t, bs) == (hashing.keys(states), int(states[-1]) if len(states) else state)


def test_a_sequence_decoding_its_known_output_block_by_block_hashes_as_all_at_once() -> None:
    """A decode that fills a block of known tokens (a multi-turn answer the next turn's prompt
    repeats) hashes that one block through `few_keys`; block by block, the sequence's keys are
    those of hashing its known tokens in one vector pass (kvcache/sequence.py `hashes_upto`)."""
    prompt, output = np.arange(50, dtype=np.int32), np.arange(1000, 1100, dtype=np.int32)
    seq = Sequence("a", prompt, uid=5, output=output, extra_key=2)
    seq.hashes_upto(48, 16)  # the prompt's 3 full blocks (more than FEW: the vector path)
    for n in range(51, 151):
        seq.num_tokens = n
        seq.hashes_upto(n, 16)
    whole = Sequence("b", np.concatenate([prompt, output]), extra_key=2)
    assert seq.block_hashes == whole.hashes_upto(144, 16) == block_keys(whole.prompt, 16, 2)
    assert len(seq.block_hashes) == 9 and seq._state == whole._state
