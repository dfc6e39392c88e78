"""P/D disaggregation's NIXL connector, one replica in one role (sim/engine/nixl.py), hand-worked.

Rules pinned (vLLM 0.33.0):
- decode side: vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py
  `NixlPullConnectorScheduler.get_num_new_matched_tokens` (the prompt less the local hit, async) and
  `update_state_after_alloc` (once: the remote flag is cleared); vllm/v1/core/sched/scheduler.py
  `Scheduler.schedule` (the whole prompt allocated up front, WAITING_FOR_REMOTE_KVS) and
  `_update_waiting_for_remote_kv` (the blocks cached, the last prompt token recomputed);
- prefill side: pull_scheduler.py `request_finished` (`delay_free_blocks` for a length-capped
  request, the lease `kv_lease_duration` from base_scheduler.py, 30 s), scheduler.py
  `_update_from_kv_xfer_finished` (the blocks freed once the send is done);
- timing: vllm/v1/worker/kv_connector_model_runner_mixin.py `_get_kv_connector_output` (reads posted
  after the forward's launch, the results polled as the step is launched);
- hybrid groups: pull_scheduler.py `update_state_after_alloc` (each group's unhashed blocks,
  `KVCacheBlocks.get_unhashed_block_ids_all_groups`, clipped by base_scheduler.py
  `get_exchange_clipped_blocks`), pull_worker.py `_read_blocks` (each group's blocks read across every
  region: a pool block's bytes each, base_worker.py `_compute_desc_ids`), scheduler.py
  `_connector_finished` (a finished request's windows let go of their skipped blocks first);
- Mamba state on the decode side: scheduler.py `_get_local_prefix_cache_hit` and `schedule`'s
  `hit_diverged` fallback, kv_cache_manager.py `get_computed_blocks_for_connector`;
- a Mamba state block's bytes: base_worker.py `_build_mamba_local` (a region a conv sub-projection and
  one for the SSM state, per layer slot holding Mamba state, `_ssm_region_indices`) and
  `_compute_desc_ids` (a Mamba group's block read across those regions), sized by
  ssm_conv_transfer_utils.py `derive_mamba_conv_split`'s `ssm_sizes`.

The cases are worked by hand for vLLM's sync `Scheduler` (`SYNC`): a lone side now runs async by
default, as `vllm serve` does, where an empty step spins for an empty forward's time while a read is in
flight, so reads land on that cadence rather than at their end (tests/sim/conform/test_conform_nixl.py
conforms the async side against vLLM's AsyncScheduler).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvsim.sim.engine.catalog import ConfigError
from kvsim.sim.engine.config import SimConfig
from kvsim.sim.engine.nixl import BlockBytes, KVTransfer, prefill_backoff, with_max_tokens_one
from kvsim.sim.engine.run import simulate
from kvsim.workloads.request import Request, Workload
from tests.sim.engine.engine_fixtures import mamba_turns

BLOCK_BYTES = 2 * 1024 * 1024  # llama-3-8b, block 16: 32 layers x 8 KV heads x 128 x K and V x 2 bytes x 16
# gpt-oss-20b, block 16: two groups of 12 layers (sliding window 128, full attention); a block of the
# pool is one group's 12 pages: 12 layers x 8 KV heads x 64 x K and V x 2 bytes x 16 tokens
GPT_OSS_BLOCK_BYTES = 12 * 8 * 64 * 2 * 2 * 16
# the step numbers, read and hold times below are worked for the sync scheduler, made explicit now that
# a lone side's async_scheduling None resolves to async (SimConfig.runs_async)
SYNC = {"async_scheduling": False}


def _requests(arrivals: list[float], prompt: int = 100, output: int = 5) -> Workload:
    return Workload.from_list([Request(id=f"r{i}", arrival=t, prompt_len=prompt, output_len=output,
                                       _prompt=np.arange(i * 1000, i * 1000 + prompt, dtype=np.int32))
                               for i, t in enumerate(arrivals)])


def _run(role: str | None, arrivals: list[float], **kw):
    cfg = SimConfig(model="llama-3-8b", kv_transfer_role=role, block_size=16, **(SYNC | {"num_gpu_blocks": 64} | kw))
    return simulate(_requests(arrivals), cfg.validate())


def test_transfer_time_is_latency_plus_bytes_over_bandwidth():
    t = KVTransfer(BlockBytes(BLOCK_BYTES), gbps=25.0, latency_s=5e-5)
    assert t.seconds(7) == pytest.approx(5e-5 + 7 * BLOCK_BYTES / 25e9, rel=1e-15)
    assert t.seconds(0) == 5e-5


def test_decode_side_reads_the_whole_prompt_then_recomputes_its_last_token():
    r = _run("decode", [0.0])
    read = KVTransfer(BlockBytes(BLOCK_BYTES)).seconds(7)  # 100 tokens: 7 blocks, none cached locally
    steps = r.steps
    rq = r.requests.set_index("id")
    # the empty step at 0 posts the read; the engine steps again when it is done, and applies it
    assert rq.at["r0", "first_scheduled"] == pytest.approx(read, abs=1e-12)
    assert steps["time"].iloc[0] == pytest.approx(read, abs=1e-12)
    assert (steps["prefill_tokens"].iloc[0], steps["context_tokens"].iloc[0]) == (1, 100)  # one token recomputed
    assert rq.at["r0", "hit_tokens"] == 0  # the log counts local hits only
    assert (r.summary["read_blocks"], r.summary["read_tokens"], r.summary["read_bytes"]) == (7, 100, 7 * BLOCK_BYTES)
    assert r.summary["finished"] == 1 and rq.at["r0", "output_tokens"] == 5


def test_a_read_posted_in_a_step_is_seen_by_the_first_step_starting_after_it_and_applied_at_its_end():
    r = _run("decode", [0.0, 0.01])
    steps, rq = r.steps, r.requests.set_index("id")
    t = steps["time"].to_numpy()
    read = KVTransfer(BlockBytes(BLOCK_BYTES)).seconds(7)
    posted = int(np.searchsorted(t, 0.01))  # r1 arrives during a step; the next step admits it
    assert t[posted] + read <= t[posted + 1]  # done before the next step starts: that step's poll sees it
    assert rq.at["r1", "first_scheduled"] == t[posted + 2]  # applied as it ends, promoted by the schedule after
    # a 29 ms read: the engine waits for r0's, wakes for r1's arrival at 0.01 and posts r1's read in
    # that empty step; r1's read is seen by the first step starting once it is done, then promoted
    slow = _run("decode", [0.0, 0.01], kv_transfer_gbps=0.5)
    st, sq = slow.steps["time"].to_numpy(), slow.requests.set_index("id")
    read = KVTransfer(BlockBytes(BLOCK_BYTES), gbps=0.5).seconds(7)
    assert sq.at["r0", "first_scheduled"] == pytest.approx(read, abs=1e-12)
    seen = int(np.searchsorted(st, 0.01 + read))
    assert st[seen - 1] < 0.01 + read <= st[seen]
    assert sq.at["r1", "first_scheduled"] == st[seen + 1]


def test_prefill_side_runs_one_token_and_holds_its_blocks_until_read():
    # 10 blocks: r0 holds 7 until the decode side has read them, so r1 (7 blocks) waits for the release
    r = _run("prefill", [0.0, 0.001], num_gpu_blocks=11)
    rq = r.requests.set_index("id")
    read = KVTransfer(BlockBytes(BLOCK_BYTES)).seconds(7)
    assert list(rq["output_tokens"]) == [1, 1]
    assert rq.at["r0", "finish"] == rq.at["r0", "first_token"]
    release = rq.at["r0", "finish"] + read
    assert rq.at["r1", "first_scheduled"] == pytest.approx(release, abs=1e-12)  # the empty step at the release
    # r0's prompt blocks are cached when freed: r1 shares none (distinct tokens), so 7 blocks x the hold
    assert r.summary["held_block_seconds"] == pytest.approx(7 * read + 7 * read, rel=1e-12)


def test_prefill_side_hold_is_bounded_by_the_lease():
    r = _run("prefill", [0.0, 0.001], num_gpu_blocks=11, kv_transfer_gbps=1e-6, kv_lease_duration=0.5)
    rq = r.requests.set_index("id")
    assert rq.at["r1", "first_scheduled"] == pytest.approx(rq.at["r0", "finish"] + 0.5, abs=1e-12)


@pytest.mark.parametrize("kw, field", [
    ({"kv_transfer_role": "both"}, "kv_transfer_role must be"),
    ({"kv_transfer_role": "decode", "preemption": "swap", "num_cpu_blocks": 64}, "swap preemption"),
    ({"kv_transfer_role": "prefill", "defrag_threshold": 0.5}, "defragmentation"),
    ({"kv_transfer_role": "decode", "parallel_sampling": "fork"}, "parallel_sampling 'fork'"),
    ({"kv_transfer_role": "prefill", "vllm_version": "0.32"}, "vllm_version 0.32"),
    ({"kv_transfer_role": "decode", "kv_offloading_size": 1.0}, "kv_offloading_size"),
    ({"kv_transfer_role": "prefill", "replicas": 2}, "replicas"),
    ({"kv_transfer_gbps": 0.0}, "kv_transfer_gbps"),
    ({"kv_transfer_latency": -1.0}, "kv_transfer_latency"),
    ({"kv_lease_duration": 0.0}, "kv_lease_duration"),
])
def test_bad_settings_are_refused_in_one_line(kw, field):
    with pytest.raises(ConfigError, match=field) as e:
        SimConfig(model="llama-3-8b", **kw).validate()
    assert "\n" not in str(e.value)


def test_a_hybrid_decode_sides_read_is_recorded_group_by_group():
    """`HybridKVCacheManager.record_loaded` (gpt-oss-20b, block 16: group 0 a 128-token window, group 1
    full attention): the read of a 1000-token prompt, applied before step 0, is recorded as each group's
    writes of the blocks it loaded (write ops: block, first and end slot, position): full attention's 63
    blocks, the window's last 9 (vLLM's exchange clip, cdiv(128, 16) + 1; its table holds nulls before
    them); then step 0 recomputes the prompt's last token in both. The read is recorded, not counted:
    5 counted writes are the recompute and the 4 decodes."""
    cfg = SimConfig(model="gpt-oss-20b", kv_transfer_role="decode", record_ops=True, block_size=16,
                    **(SYNC | {"num_gpu_blocks": 400}))
    run = simulate(_requests([0.0], prompt=1000), cfg.validate())
    writes = [o for o in run.manager.ops.records() if o.kind == "write" and o.step == 0]
    spans = {g: [(o.pos, o.b, o.c) for o in writes if o.group == g] for g in (0, 1)}
    assert spans[1] == [(16 * i, 0, 16) for i in range(62)] + [(992, 0, 8), (999, 7, 8)]
    assert spans[0] == [(16 * i, 0, 16) for i in range(54, 62)] + [(992, 0, 8), (999, 7, 8)]
    assert run.manager.op_counts["write"] == 5


def test_a_lone_side_and_a_pd_cluster_run_async_as_vllm_serve_does():
    """vLLM 0.33 vllm/config/vllm.py `VllmConfig.__post_init__`: async_scheduling None resolves to
    True unless a pooling model, an executor without it, ROCm DeepEP high-throughput DBO or the V1
    runner's incompatibilities (pipeline parallelism, some speculative methods); a KV connector
    (kv_transfer_config) is not among them, so a lone NIXL side runs vllm/v1/core/sched/async_scheduler.py
    `AsyncScheduler` by default, and takes async_scheduling=True; so do a P/D cluster's replicas."""
    for role in ("decode", "prefill"):
        assert SimConfig(kv_transfer_role=role).runs_async is True
        assert SimConfig(kv_transfer_role=role, async_scheduling=False).runs_async is False
    SimConfig(kv_transfer_role="prefill", async_scheduling=True).validate()
    SimConfig(kv_transfer_role="decode", async_scheduling=True).validate()
    assert SimConfig(prefill_replicas=1, decode_replicas=1).runs_async is True
    SimConfig(prefill_replicas=1, decode_replicas=1, async_scheduling=True).validate()
    assert SimConfig(prefill_replicas=1, decode_replicas=1, async_scheduling=False).runs_async is False


def _gpt_oss(role: str, arrivals: list[float], **kw):
    cfg = SimConfig(model="gpt-oss-20b", kv_transfer_role=role, block_size=16, **(SYNC | {"num_gpu_blocks": 400} | kw))
    return simulate(_requests(arrivals, prompt=1000), cfg.validate())


def test_hybrid_decode_side_reads_each_groups_blocks_the_window_only_its_last():
    # 1000 tokens: full attention reads cdiv(1000, 16) = 63 blocks; the window (128) skips
    # 1000 - 128 + 1 = 873 tokens = 54 whole blocks, so it reads 63 - 54 = 9: 72 blocks of the pool
    r = _gpt_oss("decode", [0.0])
    assert (r.summary["read_blocks"], r.summary["read_tokens"]) == (72, 1000)
    assert r.summary["read_bytes"] == 72 * GPT_OSS_BLOCK_BYTES
    rq = r.requests.set_index("id")
    assert rq.at["r0", "first_scheduled"] == pytest.approx(KVTransfer(BlockBytes(GPT_OSS_BLOCK_BYTES)).seconds(72), abs=1e-12)
    assert r.steps["prefill_tokens"].iloc[0] == 1 and rq.at["r0", "output_tokens"] == 5


def test_hybrid_prefill_side_holds_every_groups_blocks_in_the_window_until_read():
    # r0 finishes with 1000 computed: the window lets its 54 skipped blocks go, and 63 + 9 = 72 blocks
    # are held until the (lone) decode side's read of those 72 ends
    r = _gpt_oss("prefill", [0.0])
    rq = r.requests.set_index("id")
    read = KVTransfer(BlockBytes(GPT_OSS_BLOCK_BYTES)).seconds(72)
    assert rq.at["r0", "output_tokens"] == 1
    assert r.summary["held_block_seconds"] == pytest.approx(72 * read, rel=1e-12)


# qwen3-next-80b-a3b at TP 8 on an H100: block 192 (vLLM raises it so a Mamba state, 137,216 bytes a
# layer, fits one page), three Mamba groups and one full-attention group of 12 layers each; a pool
# block is one group's 12 pages: 12 layers x 1 KV head a rank x 256 x K and V x 2 bytes x 192 tokens
QWEN3_NEXT_BLOCK_BYTES = 12 * 1 * 256 * 2 * 2 * 192
# a Mamba group's block as the NIXL worker reads it: in each of the 12 layer slots, a gated delta net's
# conv state (Q, K, V sub-projections: 256 + 256 + 512 columns of a rank x 3 rows x 2 bytes) and its
# SSM state (4 value heads a rank x 128 x 128 x 2 bytes), not the 196,608-byte padded page
QWEN3_NEXT_STATE_BYTES = 12 * ((256 + 256 + 512) * 3 * 2 + 4 * 128 * 128 * 2)


def _qwen3_next(role: str, prompt: int, **kw):
    cfg = SimConfig(model="qwen3-next-80b-a3b", tensor_parallel=8, kv_transfer_role=role, **(SYNC | {"num_gpu_blocks": 400} | kw))
    req = Request(id="r0", arrival=0.0, prompt_len=prompt, output_len=5, _prompt=np.arange(prompt, dtype=np.int32))
    return simulate(Workload.from_list([req]), cfg.validate())


def test_mamba_prefill_side_computes_all_but_the_last_prompt_token_and_holds_one_state_block_a_group():
    # vLLM base_scheduler.py `_prefill_backoff` (1 with Mamba state) and `_truncate_request_for_prefill`
    # (from `on_new_request`): the prefill side drops the prompt's last token, so a 1000-token prompt
    # computes 999 in one step and samples its one token. At its finish (scheduler.py
    # `_connector_finished`) each Mamba group lets go of the states before its last
    # (single_type_kv_cache_manager.py `MambaManager.remove_skipped_blocks`), and `request_finished`
    # offers what `get_exchange_clipped_blocks` keeps (`clip_ssm_state_blocks`: the running state):
    # cdiv(999, 192) = 6 attention blocks of 2,359,296 bytes + 1 state block of 1,646,592 in each of 3
    # Mamba groups = 9 blocks, held until the (lone) decode side's read of those 9 ends:
    # 6 x 2,359,296 + 3 x 1,646,592 = 19,095,552 bytes, 5e-5 + 19,095,552 / 25e9 = 0.00081382208 s
    # (a pool block's bytes for the state blocks, as before: 21,233,664 bytes, 0.00089934656 s)
    assert (QWEN3_NEXT_BLOCK_BYTES, QWEN3_NEXT_STATE_BYTES) == (2_359_296, 1_646_592)
    r = _qwen3_next("prefill", 1000)
    rq = r.requests.set_index("id")
    assert list(r.steps["prefill_tokens"]) == [999]
    assert (rq.at["r0", "prompt_tokens"], rq.at["r0", "output_tokens"]) == (999, 1)
    read = KVTransfer(BlockBytes(QWEN3_NEXT_BLOCK_BYTES, QWEN3_NEXT_STATE_BYTES)).seconds(6, 3)
    assert read == 5e-5 + 19_095_552 / 25e9 == pytest.approx(0.00081382208, rel=1e-15)
    assert r.summary["held_block_seconds"] == pytest.approx(9 * read, rel=1e-12)


def test_mamba_prefill_side_keeps_a_one_token_prompt_whole():
    # `_truncate_request_for_prefill` only when the prompt is longer than the backoff: one token is
    # computed, 1 attention block + 3 state blocks held, read in 5e-5 + (2,359,296 + 3 x 1,646,592) / 25e9 s
    r = _qwen3_next("prefill", 1)
    assert list(r.steps["prefill_tokens"]) == [1]
    read = KVTransfer(BlockBytes(QWEN3_NEXT_BLOCK_BYTES, QWEN3_NEXT_STATE_BYTES)).seconds(1, 3)
    assert read == 5e-5 + 7_299_072 / 25e9
    assert r.summary["held_block_seconds"] == pytest.approx(4 * read, rel=1e-12)


def test_the_prefill_backoff_and_the_proxys_request():
    # base_scheduler.py `_prefill_backoff`: 1 with Mamba layers (kvsim's catalog has no bounded replay
    # or multi-token prediction); the truncated request keeps the first prompt_len - 1 token ids
    from kvsim.sim.engine.cost_model import CostModel

    costs = [CostModel.from_config(SimConfig(model=m, tensor_parallel=tp))
             for m, tp in (("qwen3-next-80b-a3b", 8), ("gpt-oss-20b", 1), ("llama-3-8b", 1))]
    assert [prefill_backoff(c) for c in costs] == [1, 0, 0]  # Mamba state; windows and full attention not
    req = Request(id="a", arrival=0.5, prompt_len=4, output_len=9, _prompt=np.array([7, 8, 9, 10], dtype=np.int32))
    out = with_max_tokens_one(req, 1)
    assert (out.id, out.arrival, out.prompt_len, out.output_len, list(out.prompt)) == ("a", 0.5, 3, 1, [7, 8, 9])
    whole = with_max_tokens_one(req)
    assert (whole.prompt_len, whole.output_len, list(whole.prompt)) == (4, 1, [7, 8, 9, 10])
    one = Request(id="b", arrival=0.0, prompt_len=1, output_len=3, _prompt=np.array([5], dtype=np.int32))
    assert with_max_tokens_one(one, 1).prompt_len == 1


def test_a_mamba_decode_side_takes_full_attentions_deeper_hit_with_a_load_and_reconciles_without_one():
    # qwen3-next-80b-a3b on an H100 at TP 8: blocks of 192, three Mamba groups and one full-attention
    # group. r0 (500 tokens) reads 499 (the backoff of one: base_scheduler.py
    # `_get_remote_prefill_token_count`): 3 attention blocks + one state block a Mamba group = 6; its
    # 384 tokens of full blocks are cached in full attention, and no Mamba state on a block boundary.
    # r1 (r0's prompt + 100): full attention hits 384, the Mamba groups 0, so with the NIXL connector
    # (connector.py `supports_divergent_local_hybrid_hits`) the local hit is 384
    # (kv_cache_manager.py `get_computed_blocks_for_connector`) and it reads 599 - 384 = 215 tokens:
    # 2 attention blocks + 3 state blocks. r2 (r0's first 384 + 1): full attention hits 384 = all it
    # would read, so nothing is loaded and the hit is reconciled to 0 (scheduler.py `schedule`:
    # `hit_diverged and num_external_computed_tokens == 0` -> `get_computed_blocks`): computed here
    cfg = SimConfig(model="qwen3-next-80b-a3b", tensor_parallel=8, gpu="h100-sxm", kv_transfer_role="decode", **SYNC)
    r = simulate(Workload.from_list(mamba_turns()), cfg.validate())
    rq = r.requests.set_index("id")
    assert list(rq["hit_tokens"]) == [0, 384, 0] and list(rq["output_tokens"]) == [5, 5, 5]
    # read bytes: 5 attention blocks and 6 state blocks, each at its kind's bytes
    assert r.summary["kv_bytes_per_block"] == QWEN3_NEXT_BLOCK_BYTES
    assert (r.summary["read_blocks"], r.summary["read_tokens"], r.summary["read_bytes"]) == \
        (11, 714, 5 * QWEN3_NEXT_BLOCK_BYTES + 6 * QWEN3_NEXT_STATE_BYTES) == (11, 714, 21_676_032)
    assert rq.at["r2", "first_scheduled"] == 10.0  # no read: admitted as it arrives


def test_windowed_models_are_refused():
    with pytest.raises(ConfigError, match="sliding window|P/D disaggregation"):
        simulate(_requests([0.0]), SimConfig(model="mistral-7b", kv_transfer_role="decode").validate())


def test_a_landed_request_needing_no_block_still_waits_for_the_watermark():
    # vllm/v1/core/kv_cache_manager.py `KVCacheManager.allocate_slots`: a WAITING request, while others
    # run, needs its new blocks plus the watermark free, even when it needs no new block (a landed read
    # whose last prompt token is recomputed in a block it holds; vllm/v1/core/sched/scheduler.py
    # `_update_waiting_for_remote_kv`). 16 usable blocks, watermark int(0.2 x 17) = 3: both prompts
    # (7 blocks each) are allocated at 0 with nothing running and land together; r0 is promoted first,
    # then r1 finds 2 blocks free < 3 and waits until r0 finishes (step 4) and frees its blocks
    r = _run("decode", [0.0, 0.0], num_gpu_blocks=17, watermark=0.2, scheduler_reserve_full_isl=False)
    rq = r.requests.set_index("id")
    assert (rq.at["r0", "first_scheduled_step"], rq.at["r0", "finish_step"]) == (0, 4)
    assert (rq.at["r1", "first_scheduled_step"], rq.at["r1", "finish_step"]) == (5, 9)
    assert list(r.steps["prefill_tokens"][:6]) == [1, 0, 0, 0, 0, 1]  # each recomputes its last prompt token


def test_a_mamba_state_blocks_bytes_are_its_conv_and_ssm_state_not_its_padded_page():
    # qwen3-next-80b-a3b at TP 8: the layout's one figure for a state block, and what a read of one
    # request's blocks weighs: 6 attention blocks + 3 state blocks = 19,095,552 bytes a rank (as
    # pool blocks, 21,233,664: the state blocks were 2,359,296 / 1,646,592 = 1.43 x too heavy)
    from kvsim.sim.engine.cost_model import CostModel

    cost = CostModel.from_config(SimConfig(model="qwen3-next-80b-a3b", tensor_parallel=8, gpu="h100-sxm"))
    assert (cost.layout.mamba_page_bytes, cost.layout.state_read_bytes) == (137_216, QWEN3_NEXT_STATE_BYTES)
    blocks = BlockBytes.of(cost)
    assert blocks == BlockBytes(QWEN3_NEXT_BLOCK_BYTES, QWEN3_NEXT_STATE_BYTES, 3)
    assert (blocks.split(9), blocks.read_bytes(9)) == ((6, 3), 19_095_552)
    # a model without Mamba state: every block at the pool block's bytes
    llama = BlockBytes.of(CostModel.from_config(SimConfig(model="llama-3-8b")))
    assert (llama, llama.split(7), llama.read_bytes(7)) == (BlockBytes(BLOCK_BYTES), (7, 0), 7 * BLOCK_BYTES)
    with pytest.raises(ValueError, match="fewer than its 3 Mamba state blocks"):
        blocks.split(2)


@pytest.mark.needs_vllm
def test_the_state_bytes_are_vllms_nixl_conv_split(monkeypatch: pytest.MonkeyPatch):
    # vLLM's own decomposition of qwen3-next's gated-delta-net state at TP 8 (ssm_conv_transfer_utils.py
    # `derive_mamba_conv_split`, the sizes base_worker.py `_build_mamba_local` registers: its NIXL
    # worker asserts the DS conv layout, VLLM_SSM_CONV_STATE_LAYOUT=DS) against kvsim's layout
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.ssm_conv_transfer_utils import (
        derive_mamba_conv_split,
    )
    from vllm.model_executor.layers.mamba import mamba_utils
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    from kvsim.sim.engine.cost_model import CostModel

    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    mamba_utils.get_conv_state_layout.cache_clear()
    try:
        shapes = CostModel.from_config(SimConfig(model="qwen3-next-80b-a3b", tensor_parallel=8)).model.linear_state_shapes(8)
        spec = MambaSpec(shapes=shapes, dtypes=(torch.bfloat16, torch.bfloat16), block_size=192,
                         page_size_padded=196_608, mamba_type=MambaAttentionBackendEnum.GDN_ATTN)
        split = derive_mamba_conv_split(spec, 8)
    finally:
        mamba_utils.get_conv_state_layout.cache_clear()
    assert split.local_conv_offsets == [(0, 1536), (1536, 1536), (3072, 3072)]  # Q, K, V
    assert split.ssm_sizes == (6144, 131_072) and 12 * sum(split.ssm_sizes) == QWEN3_NEXT_STATE_BYTES


def test_the_inflight_prefills_keep_a_request_until_a_scheduled_chunk_reaches_its_known_tokens():
    """vLLM 0.33 scheduler.py `_update_after_schedule`: a request scheduled with a chunk reaching
    its known tokens plus placeholders is no longer `is_prefill_chunk` and leaves `_inflight_prefills`;
    one still loading, one scheduled short of them and one not scheduled stay. A request the speed
    shortcuts decode outside the batch (in place, or lazily) has passed its prompt: it leaves too."""
    from types import SimpleNamespace

    from kvsim.sim.engine.async_loads import AsyncLoads
    from kvsim.sim.engine.batch import Batch

    def live(computed: int, tokens: int, since: int = -1, ph: int = 0) -> SimpleNamespace:
        return SimpleNamespace(seq=SimpleNamespace(num_computed_tokens=computed, num_tokens=tokens), since=since, ph=ph)

    loads = AsyncLoads(None, priority=False)
    loading, last, short, waiting, lazy, in_place, async_last = (
        live(90, 90), live(64, 100), live(32, 100), live(32, 100), live(100, 101, since=7), live(100, 101),
        live(64, 100, ph=1))
    loads.inflight = {"loading": loading, "last": last, "short": short, "waiting": waiting, "lazy": lazy,
                      "in_place": in_place, "async_last": async_last}
    loads.loads = {"loading": (10, 80)}
    loads.schedule_chosen(Batch(lives=[last, short, async_last], tokens=[36, 32, 36], decodes=[in_place]))
    # async_last: 64 + 36 = 100 < 100 known + 1 placeholder: one more token to go
    assert sorted(loads.inflight) == ["async_last", "loading", "short", "waiting"]


def test_the_speed_shortcuts_leave_a_decode_sides_schedule_unchanged():
    """`kvsim conform --random 459:460 --pd`'s case (a decode side under a 32-token long-prefill cap
    and a 1% watermark): with the shortcuts on, a lazily decoded table one block behind used to count
    against a load's admission, and 15 of 40 requests differed from the same run with them off."""
    from dataclasses import replace

    from kvsim.sim.conform.random_cases import random_case

    case = random_case(459, pd=True)
    on = simulate(case.requests, case.cfg)
    off = simulate(case.requests, replace(case.cfg, shortcuts=False).validate())
    assert on.requests.equals(off.requests)
    assert on.summary["preemptions_recompute"] == off.summary["preemptions_recompute"] == 104
