"""llm-d's router worked by hand: the prompt text's block chain (approximateprefix/hashing.go
`hashPrompt`), the longest-prefix count (plugin.go `matchLongestPrefix`), the per-pod LRU
(indexer.go `indexer.Add`, `makeEvictionFn`), the three scorers, the weighted sum
(scheduling/scheduler_profile.go `runScorerPlugins`) and the max-score picker's random tie-break
(picker/maxscore/picker.go `Pick`), all at llm-d-inference-scheduler commit 520af47."""

import hashlib
import random
import re

import pytest

from kvsim.sim.cluster.approx_prefix import ApproxPrefixIndex
from kvsim.sim.cluster.llmd import LlmD, kv_util_scores, prefix_scores, queue_scores
from kvsim.sim.cluster.routers import EngineMetrics, RouterView, make_router
from kvsim.sim.cluster.text import token_bytes, token_text
from kvsim.sim.engine.config import ConfigError, SimConfig, parse_router_scorers
from kvsim.workloads.request import make_request


def h(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def le(x: int) -> bytes:
    return x.to_bytes(8, "little")


def test_token_text_is_four_big_endian_byte_characters():
    assert token_text([0x41424344, 1]) == "ABCD\x00\x00\x00\x01"
    assert token_bytes([0x41424344, 0xFF]) == b"ABCD\x00\x00\x00\xff"
    with pytest.raises(ValueError, match="token ids must lie in"):
        token_text([-1])


def test_hash_prompt_chains_blocks_from_the_model_and_keeps_a_partial_block():
    # blocks of 2 tokens x 4 characters = 8 bytes; 5 tokens = 20 bytes: [0:8], [8:16], partial [16:20]
    index = ApproxPrefixIndex(block_size=2, model="m")
    text = token_bytes([1, 2, 3, 4, 5])
    h0 = h(b"m")
    h1 = h(text[0:8] + le(h0))
    h2 = h(text[8:16] + le(h1))
    h3 = h(text[16:20] + le(h2))
    assert index.hashes(text) == [h1, h2, h3]
    assert index.hashes(token_bytes([1])) == []  # 4 bytes < one 8-byte block: no hashes
    # at most max_blocks blocks: the text is cut to 2 x 8 bytes first
    assert ApproxPrefixIndex(block_size=2, model="m", max_blocks=2).hashes(text) == [h1, h2]


def test_match_counts_each_held_block_until_one_no_pod_holds():
    index = ApproxPrefixIndex(lru_capacity=10)
    index.add([10, 12], 0)
    index.add([10, 11, 12], 1)
    # pod 0 lacks 11 but still counts 12: matchLongestPrefix counts per hash, stopping only when no pod has it
    assert index.match([10, 11, 12]) == {0: 2, 1: 3}
    assert index.match([10, 13, 12]) == {0: 1, 1: 1}
    assert index.match([13, 10]) == {}


def test_each_pods_lru_evicts_its_least_recent_hash():
    index = ApproxPrefixIndex(lru_capacity=3)
    index.add([1, 2, 3], 0)
    index.add([2], 1)
    index.add([1], 0)  # 1 to the front: the order is now 2, 3, 1
    index.add([4], 0)  # over capacity: 2 leaves pod 0's LRU and pod 0 leaves hash 2's pods
    assert list(index.pod_lru[0]) == [3, 1, 4]
    assert index.hash_to_pods == {1: {0}, 2: {1}, 3: {0}, 4: {0}}
    index.add([3], 1)
    index.add([5, 6], 0)  # evicts 3 then 1 from pod 0: hash 1 is held by no pod and leaves the map
    assert list(index.pod_lru[0]) == [4, 5, 6]
    assert index.hash_to_pods == {2: {1}, 3: {1}, 4: {0}, 5: {0}, 6: {0}}


def test_a_prompt_longer_than_the_lru_leaves_its_early_hashes_mapped():
    # indexer.Add fills the LRU first (evicting 7 as 10 comes in), then adds the pod to every hash's pods
    index = ApproxPrefixIndex(lru_capacity=3)
    index.add([7, 8, 9, 10], 2)
    assert list(index.pod_lru[2]) == [8, 9, 10]
    assert index.hash_to_pods == {7: {2}, 8: {2}, 9: {2}, 10: {2}}


def test_scorers_normalise_the_snapshot():
    m = [EngineMetrics(4, 1, 0.25), EngineMetrics(0, 3, 1.0), EngineMetrics(2, 0, 0.5)]
    assert queue_scores(m) == [0.0, 1.0, 0.5]  # (4 - w) / (4 - 0)
    assert queue_scores(m[:1] * 3) == [1.0, 1.0, 1.0]  # all equal: neutral 1.0
    assert kv_util_scores(m) == [0.75, 0.0, 0.5]
    assert prefix_scores({1: 1}, 2, 3) == [0.0, 0.5, 0.0]
    assert prefix_scores({}, 0, 2) == [0.0, 0.0]


def view_with(*metrics):
    view = RouterView(len(metrics))
    view.metrics = tuple(EngineMetrics(*m) for m in metrics)
    view.snapshots = 1
    return view


def test_a_pick_weighs_queue_2_kv_util_2_prefix_3():
    index = ApproxPrefixIndex(block_size=4, lru_capacity=100)  # blocks of 4 tokens
    prompt = list(range(100, 108))  # 8 tokens: 2 blocks
    index.add(index.hashes(token_bytes(prompt[:4] + [999, 998, 997, 996])), 1)  # pod 1 holds block 1 only
    router = LlmD(3, seed=0, index=index)
    view = view_with((2, 0, 0.5), (0, 0, 0.75), (1, 0, 0.0))
    # queue: (2 - w) / 2 = 0, 1, 0.5; kv: 0.5, 0.25, 1.0; prefix: 0, 1/2, 0
    # sum in the profile's order: 0*2 + 0.5*2 + 0*3 = 1.0; 1*2 + 0.25*2 + 0.5*3 = 4.0; 0.5*2 + 1*2 + 0 = 3.0
    hashes = index.hashes(token_bytes(prompt))
    assert router.scores(hashes, view) == [1.0, 4.0, 3.0]
    assert router.pick(make_request("a", 0.0, prompt, 1), view) == 1
    # the pick taught the index both blocks for pod 1: its prefix score is now 2/2
    assert index.match(hashes) == {1: 2}
    assert router.scores(hashes, view) == [1.0, 5.5, 3.0]


def test_weights_are_options():
    view = view_with((0, 0, 0.9), (5, 0, 0.0))
    index = ApproxPrefixIndex(block_size=1, lru_capacity=100)
    prompt = [1, 2]
    index.add(index.hashes(token_bytes(prompt)), 0)
    # the chart's profile: pod 0 2*1 + 2*0.1 + 3*1 = 5.2 (floats: 0.09999999999999998 * 2), pod 1 0 + 2 + 0 = 2
    assert LlmD(2, index=index).pick(make_request("a", 0.0, prompt, 1), view) == 0
    # queue and kv-util only, prefix 0: pod 0 1*1 + 0.1*5 = 1.5; pod 1 0 + 1*5 = 5
    router = LlmD(2, index=index, weights=parse_router_scorers("queue:1,kv-util:5,prefix:0"))
    assert router.pick(make_request("b", 0.0, prompt, 1), view) == 1


def test_ties_go_to_the_first_of_a_seeded_shuffle():
    # prompts below one block have no hashes, so every pod scores 2 + 2 + 0: the shuffle decides
    router = LlmD(3, seed=5)
    view = view_with((0, 0, 0.0), (0, 0, 0.0), (0, 0, 0.0))
    picks = [router.pick(make_request(str(k), 0.0, [k], 1), view) for k in range(8)]
    rng = random.Random(5)
    expected = []
    for _ in range(8):
        order = [0, 1, 2]
        rng.shuffle(order)
        expected.append(order[0])
    assert picks == expected == [0, 0, 1, 2, 1, 1, 0, 2]
    # a strictly higher score wins whatever the shuffle: pod 2 has the shortest queue
    view = view_with((1, 0, 0.0), (1, 0, 0.0), (0, 0, 0.0))
    assert {router.pick(make_request(str(k), 0.0, [k], 1), view) for k in range(8)} == {2}


def test_from_config_sizes_the_lru_to_the_pods_blocks():
    cfg = SimConfig(replicas=2, router="llm-d", block_size=32, router_scorers="prefix:1")
    router = make_router("llm-d", 2, 0, cfg, num_blocks=77)
    assert (router.index.lru_capacity, router.index.block_chars, router.weights) == (77, 128, {"prefix": 1.0})


def test_bad_scorers_are_one_error_naming_the_field():
    with pytest.raises(ConfigError, match=r"^router_scorers: expected name:weight with name one of queue, kv-util, "
                                          r"prefix, got 'lora:1'$"):
        SimConfig(replicas=2, router="llm-d", router_scorers="lora:1").validate()
    with pytest.raises(ConfigError, match="router_scorers: router round-robin weighs no scorers"):
        SimConfig(replicas=2, router="round-robin", router_scorers="prefix:1").validate()
    for text, message in (("prefix", "expected name:weight with name one of queue, kv-util, prefix, got 'prefix'"),
                          ("prefix:-1", "prefix's weight must be a number >= 0, got '-1'"),
                          ("prefix:1,prefix:2", "prefix given twice"),
                          ("prefix:nan", "prefix's weight must be a number >= 0, got 'nan'"),
                          ("", "expected name:weight with name one of queue, kv-util, prefix, got ''")):
        with pytest.raises(ConfigError, match="^router_scorers: " + re.escape(message) + "$"):
            parse_router_scorers(text, "llm-d")
