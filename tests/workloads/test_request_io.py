"""Request streaming helpers and the kvsim JSONL round trip."""

import numpy as np
import pytest

from kvsim.workloads.jsonl import write_jsonl
from kvsim.workloads.request import Workload, iter_chunks, make_request
from kvsim.workloads.traces import load_workload


def test_iter_chunks_groups_in_order():
    reqs = [make_request(str(i), i, [i], 1) for i in range(5)]
    assert [[r.id for r in c] for c in iter_chunks(reqs, 2)] == [["0", "1"], ["2", "3"], ["4"]]
    assert [len(c) for c in Workload.from_list(reqs).iter_chunks(5)] == [5]
    with pytest.raises(ValueError, match="chunk size must be >= 1, got 0"):
        list(iter_chunks(reqs, 0))


def test_lazy_prompt_is_checked_and_cached():
    calls = []

    def make():
        calls.append(1)
        return np.arange(3)

    r = make_request("x", 0, make, 4, prompt_len=3)
    assert r.prompt.dtype == np.int32 and r.prompt.tolist() == [0, 1, 2]
    r.prompt  # noqa: B018
    assert calls == [1]
    bad = make_request("y", 0, make, 4, prompt_len=5)
    with pytest.raises(ValueError, match="lazy prompt has 3 tokens, expected 5"):
        bad.prompt  # noqa: B018


def test_jsonl_round_trip_keeps_every_field(tmp_path):
    reqs = [
        make_request("a", 0.0, [1, 2, 3], 2, output=[7, 8], session="s", think_time=None),
        make_request(
            "b", 1.5, [1, 2, 3, 7, 8, 4], 1, n=3, priority=-2, session="s", think_time=1.25
        ),
    ]
    path = tmp_path / "w.jsonl"
    assert write_jsonl(reqs, path) == 2
    assert path.read_text().splitlines()[0] == (
        '{"id":"a","arrival":0.0,"prompt":[1,2,3],"output_len":2,"output":[7,8],"session":"s"}'
    )
    back = list(load_workload(path))
    assert [(r.id, r.arrival, r.prompt.tolist(), r.output_len) for r in back] == [
        ("a", 0.0, [1, 2, 3], 2),
        ("b", 1.5, [1, 2, 3, 7, 8, 4], 1),
    ]
    assert back[0].output.tolist() == [7, 8] and back[1].output is None
    assert (back[1].n, back[1].priority, back[1].session, back[1].think_time) == (3, -2, "s", 1.25)


def test_a_copy_sharing_the_prompt_makes_a_lazy_prompt_once():
    calls = []
    req = make_request("r", 0.0, lambda: calls.append(1) or np.arange(5), 3, prompt_len=5)
    copy = req.sharing_prompt(output_len=1, output=None)
    assert (copy.id, copy.output_len, req.output_len) == ("r", 1, 3)
    assert copy.prompt is req.prompt and copy.prompt.tolist() == [0, 1, 2, 3, 4]
    assert calls == [1]


def test_copies_sharing_the_prompt_hash_its_blocks_once(monkeypatch):
    """A P/D request's prefill copy (its prompt one token shorter: the Mamba backoff) and its decode
    copy get the keys `prefix_keys` gives each alone, and the second takes the first's, hashed once."""
    from kvsim.kvcache import hashing
    from kvsim.sim.engine import wait_queue
    from kvsim.sim.engine.batch import Live
    from kvsim.sim.engine.nixl import with_max_tokens_one

    hashed = []
    real = hashing.prefix_keys
    monkeypatch.setattr(wait_queue, "prefix_keys", lambda prompts, bs: hashed.append(len(prompts)) or real(prompts, bs))
    req = make_request("r", 0.0, np.arange(100, 150), 3)  # 50 tokens: 3 full blocks of 16, as 49 are
    prefill, decode = with_max_tokens_one(req, backoff=1), req
    lives = []
    for r in (prefill, decode):
        live = Live(r, 0)
        wait_queue.WaitQueue(False).hash_ahead(live, 16)
        lives.append(live)
    assert hashed == [1]  # the decode copy hashed nothing
    for live, r in zip(lives, (prefill, decode), strict=True):
        assert live.keys == real([r.prompt], 16)[0]
    assert lives[0].keys[0] is not lives[1].keys[0]  # each sequence extends its own list
    assert req.keys_memo == {}  # taken, not kept

    whole = make_request("w", 0.0, np.arange(100, 148), 3)  # 48 tokens: the prefill copy has 2 full blocks
    lives = [Live(r, 0) for r in (with_max_tokens_one(whole, backoff=1), whole)]
    for live in lives:
        wait_queue.WaitQueue(False).hash_ahead(live, 16)
    assert hashed == [1, 1, 1] and [len(live.keys[0]) for live in lives] == [2, 3]
