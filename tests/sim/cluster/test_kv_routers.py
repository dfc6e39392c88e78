"""The routers fed by KV events, worked by hand: the event index and its delay, llm-d's precise
profile (llm-d-inference-scheduler 520af47, llm-d-kv-cache 7be76e1) and Dynamo's cost
(ai-dynamo/dynamo lib/llm/src/kv_router/scheduler.rs, sequence.rs), and small cluster runs where
they land a shared prefix where it is cached."""

import math
import random

import pytest
import simpy

from kvsim.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvsim.kvcache.hashing import block_keys
from kvsim.sim.api import default_workload
from kvsim.sim.cluster.cluster import Cluster
from kvsim.sim.cluster.kv_index import DelayedEvents, PrefixIndex
from kvsim.sim.cluster.kv_routers import MEDIUM_WEIGHTS, Dynamo, LlmdPrecise
from kvsim.sim.cluster.routers import EngineMetrics, RouterView
from kvsim.sim.cluster.run import simulate_cluster
from kvsim.sim.engine.config import ConfigError, SimConfig, parse_router_scorers
from kvsim.sim.engine.cost_model import CostModel
from kvsim.sim.engine.run import make_manager
from kvsim.workloads.request import make_request

PROMPT = list(range(64))  # four full blocks of 16
KEYS = block_keys(PROMPT, 16)


def stored(replica, hashes, medium="GPU", ts=0.0):
    return EventBatch(ts, replica, 0, [BlockStored(list(hashes), None, [], 16, medium)])


def test_index_follows_stores_removals_and_clears():
    index = PrefixIndex(3)
    index.apply(stored(0, KEYS[:3]))
    index.apply(stored(1, KEYS[:1], "CPU"))
    index.apply(stored(1, KEYS[:1]))  # the same block on both mediums
    index.apply(stored(2, KEYS[1:]))  # no first block: no prefix
    assert index.sizes == [3, 1, 3]
    assert index.overlaps(KEYS) == [3, 1, 0]
    # llm-d's LongestPrefixScorer: a block counts its best medium (GPU 1.0 over CPU 0.8)
    assert index.weighted_prefix(KEYS, {"gpu": 1.0, "cpu": 0.8}) == {0: 3.0, 1: 1.0}
    index.apply(EventBatch(0.0, 1, 1, [BlockRemoved([KEYS[0]], "GPU")]))
    assert index.weighted_prefix(KEYS, {"gpu": 1.0, "cpu": 0.8}) == {0: 3.0, 1: 0.8}
    index.apply(EventBatch(0.0, 0, 1, [BlockRemoved([KEYS[1]])]))
    assert index.overlaps(KEYS) == [1, 1, 0]  # the run stops at the hole
    index.apply(EventBatch(0.0, 2, 1, [AllBlocksCleared()]))
    assert index.sizes == [2, 1, 0]
    assert KEYS[3] not in index.holders


def test_a_batch_is_due_only_delay_after_its_step_ended():
    """A batch reaches the index `delay` after its step ended: applied by the pick that finds it
    due, or by a later send once the clock has passed its time, so a run holds only the batches
    not yet due. A batch due before one already applied would reorder the index: an error."""
    now = [0.0]
    index = PrefixIndex(2)
    events = DelayedEvents(0.25, index, lambda: now[0])
    events.send(stored(1, KEYS[:1], ts=0.125))
    events.send(stored(0, KEYS[:1], ts=0.5))
    events.apply_due(0.374)
    assert index.sizes == [0, 0] and len(events) == 2
    events.apply_due(0.375)  # 0.125 + 0.25
    assert index.sizes == [0, 1] and len(events) == 1
    now[0] = 0.75  # the clock has passed the other's time: the next send applies it
    events.send(stored(1, KEYS[1:2], ts=0.75))
    assert index.sizes == [1, 1] and len(events) == 1
    events.apply_due(10.0)
    assert index.sizes == [1, 2] and len(events) == 0
    events.apply_due(10.0)  # each applied once
    assert index.sizes == [1, 2]
    with pytest.raises(RuntimeError, match="KV events out of order: replica 0's step"):
        events.send(stored(0, KEYS[2:3], ts=0.5))


class IndexSpy(LlmdPrecise):
    """llm-d-precise that records which replicas its index shows holding the prompt's first block
    at each pick, and sends everything to replica 0."""

    def __init__(self):
        super().__init__(2, block_size=16)
        self.seen = []

    def pick(self, request, view):
        self.seen.append((request.id, view.now, sorted(self.index.holders.get(KEYS[0], {}))))
        return 0


def test_the_router_sees_a_step_events_only_kv_event_delay_after_the_step():
    # r0's prefill runs in step 0, [0, 0.125): its two blocks are cached and published as the
    # step ends (ts 0.125); with a 0.25 s delay they reach the index at 0.375, not before
    cfg = SimConfig(num_gpu_blocks=64, replicas=2, router="llm-d-precise", step_time=0.125, kv_event_delay=0.25)
    reqs = [make_request("r0", 0.0, PROMPT, 4)] + [
        make_request(f"r{i}", t, PROMPT, 4) for i, t in enumerate((0.125, 0.374, 0.375), start=1)]
    env = simpy.Environment()
    cost = CostModel.from_config(cfg)
    spy = IndexSpy()
    Cluster(env, reqs, cfg, cost, [make_manager(cfg.replace(kv_events=True), cost) for _ in range(2)], router=spy)
    env.run()
    assert spy.seen == [("r0", 0.0, []), ("r1", 0.125, []), ("r2", 0.374, []), ("r3", 0.375, [0])]
    # the engine's event hashes are the router's block keys of the prompt: 4 full blocks cached
    assert all(spy.index.holders[k] == {0: {"gpu"}} for k in KEYS)


def test_the_index_holds_the_cpu_tiers_blocks_and_llm_d_weighs_them_0_8():
    # With KV offloading each replica also publishes its CPU tier's events (kvcache/events.py
    # HostEventLog, vLLM's OffloadingConnector). r0's 4 prompt blocks are cached (step 0) and stored
    # to the tier, a block a step on the link (BlockStored CPU at step 5); x's 7 blocks evict 3 of
    # them from the 8-block GPU cache (step 8). At r1's pick the index holds block 0 on both
    # mediums and blocks 1-3 on the CPU only: llm-d's LongestPrefixScorer counts 1 + 3 x 0.8
    link = CostModel.from_config(SimConfig()).op_cost_s["store"]
    chunk = CostModel.from_config(SimConfig()).kv_bytes_per_block
    cfg = SimConfig(num_gpu_blocks=9, replicas=2, router="llm-d-precise", step_time=link, kv_event_delay=0.0,
                    kv_offloading_size=16 * chunk / (1 << 30), max_num_batched_tokens=256).validate()
    reqs = [make_request("r0", 0.0, PROMPT, 1), make_request("x", 8 * link, list(range(5000, 5112)), 1),
            make_request("r1", 20 * link, PROMPT, 1)]
    env = simpy.Environment()
    cost = CostModel.from_config(cfg)
    spy = IndexSpy()
    Cluster(env, reqs, cfg, cost, [make_manager(cfg.replace(kv_events=True), cost) for _ in range(2)], router=spy)
    env.run()
    assert [spy.index.holders[k] for k in KEYS] == [{0: {"gpu", "cpu"}}] + [{0: {"cpu"}}] * 3
    assert spy.index.weighted_prefix(KEYS, MEDIUM_WEIGHTS) == {0: 1.0 + 0.8 + 0.8 + 0.8}


def view_with(waiting, usage):
    view = RouterView(len(waiting))
    view.metrics = tuple(EngineMetrics(w, 0, u) for w, u in zip(waiting, usage, strict=True))
    return view


def test_llm_d_precise_sums_its_profile_by_hand():
    router = LlmdPrecise(3, block_size=16)
    router.index.apply(stored(0, KEYS[:2]))
    router.index.apply(stored(1, KEYS[:1], "CPU"))
    view = view_with([2, 0, 1], [0.5, 0.25, 0.0])
    request = make_request("q", 0.0, PROMPT, 4)
    # prefix (absoluteScoredPods: matched / 4 full blocks): 2/4, 0.8/4, 0
    assert router.prefix_scores(request) == [0.5, 0.2, 0.0]
    # kv-util (1 - usage): 0.5, 0.75, 1.0; queue ((max - w) / (max - min), waiting 2, 0, 1): 0, 1, 0.5
    assert router.scores(request, view) == [0.5 * 2 + 0.5 + 0.0, 0.2 * 2 + 0.75 + 1.0, 0.0 * 2 + 1.0 + 0.5]
    assert router.pick(request, view) == 1


def test_llm_d_precise_weights_and_seeded_ties():
    router = LlmdPrecise(3, seed=5, block_size=16, weights=parse_router_scorers("prefix:3,queue:2,kv-util:2"))
    router.index.apply(stored(2, KEYS))
    view = view_with([0, 0, 4], [0.0, 0.0, 0.5])
    request = make_request("q", 0.0, PROMPT, 4)
    # prefix 0, 0, 1 (x3); queue 1, 1, 0 (x2); kv-util 1, 1, 0.5 (x2)
    assert router.scores(request, view) == [4.0, 4.0, 4.0]
    draws = random.Random(5)
    expected = [[0, 1, 2][draws.randrange(3)] for _ in range(6)]  # the max-score picker's shuffle: any of the tied
    assert [router.pick(request, view) for _ in range(6)] == expected
    # fewer than a block of prompt: no prefix score (getScores: floor(tokens / block size) = 0)
    assert router.prefix_scores(make_request("s", 0.0, list(range(15)), 4)) == [0.0, 0.0, 0.0]


def test_router_scorers_parse_and_refuse():
    assert parse_router_scorers(None) == {"prefix": 2.0, "kv-util": 1.0, "queue": 1.0}
    assert list(parse_router_scorers("queue:2, prefix:0.5")) == ["queue", "prefix"]
    for text, message in (("prefix:3,hits:1", "router_scorers: expected name:weight with name one of prefix, kv-util, "
                                               "queue, got 'hits:1'"),
                          ("prefix", "router_scorers: expected name:weight with name one of prefix, kv-util, queue, "
                                     "got 'prefix'"),
                          ("queue:1,queue:2", "router_scorers: queue given twice"),
                          ("queue:-1", "router_scorers: queue's weight must be a number >= 0, got '-1'")):
        with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(") + "$"):
            SimConfig(replicas=2, router="llm-d-precise", router_scorers=text).validate()
    with pytest.raises(ConfigError, match=r"^router_scorers: router dynamo weighs no scorers \(those that do: llm-d, "
                                          r"llm-d-precise\)$"):
        SimConfig(replicas=2, router="dynamo", router_scorers="queue:1").validate()
    with pytest.raises(ConfigError, match="kv_event_delay must be a number >= 0, got -0.5"):
        SimConfig(replicas=2, router="dynamo", kv_event_delay=-0.5).validate()


def dynamo_with_load():
    """Three workers: 0 holds the prompt's first 3 blocks and has a request in flight (6 other
    blocks, 40 prefill tokens left); 1 holds the first block; 2 nothing."""
    router = Dynamo(3, block_size=16)
    router.index.apply(stored(0, KEYS[:3]))
    router.index.apply(stored(1, KEYS[:1]))
    router.pick(make_request("busy", 0.0, list(range(1000, 1096)), 4), RouterView(3))  # 6 blocks
    return router


def test_dynamo_cost_by_hand():
    router = dynamo_with_load()
    # busy went to worker 2 (logits 6+6, 6+6, 6+6 tied; trees 3, 1, 0: the smallest)
    assert router.active["busy"][0] == 2 and router.prefill_tokens == [0, 0, 96]
    router.blocks[0], router.blocks[2] = router.blocks[2], {}  # move it to worker 0 for this case
    router.prefill_tokens = [40, 0, 0]
    request = make_request("q", 0.0, PROMPT, 4)
    logits, _ = router.logits(request, RouterView(3))
    # prefill_blocks = (active prefill + isl - overlap x 16) / 16; decode_blocks = active + new blocks
    assert logits == [(40 + 64 - 3 * 16) / 16 + (6 + 4), (0 + 64 - 16) / 16 + (0 + 4), (0 + 64) / 16 + (0 + 4)]
    assert router.pick(request, RouterView(3)) == 1
    assert router.prefill_tokens == [40, 48, 0] and sorted(router.blocks[1]) == sorted(KEYS)


def test_dynamo_drops_prefill_tokens_at_the_first_token_and_blocks_at_the_finish():
    router = Dynamo(2, block_size=16)
    view = RouterView(2)
    first = router.pick(make_request("a", 0.0, PROMPT, 4), view)
    assert first == random.Random(0).randrange(2) == 1  # logits 8, 8 and empty trees: a draw
    assert (router.prefill_tokens, len(router.blocks[1])) == ([0, 64], 4)
    assert router.logits(make_request("b", 0.0, PROMPT, 4), view)[0] == [64 / 16 + 4, (64 + 64) / 16 + 4]
    view.prefilled = lambda rid: rid == "a"
    # a's first token is out: its prefill tokens go; b shares its 4 blocks on 1: 64/16 + 4 + 0 there
    assert router.logits(make_request("b", 0.0, PROMPT, 4), view)[0] == [64 / 16 + 4, 64 / 16 + 4]
    assert router.prefill_tokens == [0, 0]
    router.finished(make_request("a", 0.0, PROMPT, 4), 1)
    assert router.blocks == [{}, {}]


def test_dynamo_temperature_samples_softmax_of_the_scaled_costs():
    router = Dynamo(3, seed=11, block_size=16, temperature=0.5)
    logits = [12.0, 7.0, 8.0]
    scaled = [-(v / 5.0) / 0.5 for v in logits]  # range 5
    weights = [math.exp(s - max(scaled)) for s in scaled]
    probs = [w / sum(weights) for w in weights]
    draws = random.Random(11)
    expected = []
    for _ in range(20):
        u, acc = draws.random(), 0.0
        for i, p in enumerate(probs):
            acc += p
            if u <= acc:
                expected.append(i)
                break
    assert [router._select(logits) for _ in range(20)] == expected
    # e^-2 / (e^-2 + 1 + e^-0.4): the costliest is still drawn, rarely
    assert [round(p, 4) for p in probs] == [0.0750, 0.5538, 0.3712]


# the embedded workload (shared system prompts and chat sessions) over 3 replicas of 200 blocks,
# sync scheduling (the hit rates below are the sync scheduler's)
CLUSTER = SimConfig(num_gpu_blocks=200, replicas=3, async_scheduling=False)


@pytest.fixture(scope="module")
def workload():
    return default_workload()


@pytest.mark.parametrize("router, hit_rate, requests", [
    ("round-robin", 0.43197098481390556, [100, 100, 100]),
    ("llm-d-precise", 0.6438607961905232, [89, 122, 89]),
    ("dynamo", 0.5678686421337018, [83, 101, 116]),
])
def test_event_fed_routers_land_shared_prefixes_where_they_are_cached(workload, router, hit_rate, requests):
    run = simulate_cluster(workload, CLUSTER.replace(router=router))
    section = run.summary["cluster"]
    assert section["overall"]["hit_rate"] == hit_rate
    assert [r["requests"] for r in section["per_replica"]] == requests
