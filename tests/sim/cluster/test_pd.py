"""A P/D cluster (sim/cluster/pd.py): one request's path through both pools worked by hand, the
link shared by concurrent reads, the deciders in place, and a cluster that never disaggregates
behaving as the aggregated cluster of its decode pool.

Protocol pinned (vLLM 0.33.0): nixl/pull_scheduler.py `request_finished` (the prefill side holds its
blocks until the read), `get_num_new_matched_tokens` (the decode side reads the prompt less its local
hit), scheduler.py `_update_waiting_for_remote_kv`; polls as in tests/sim/engine/test_nixl.py."""

from __future__ import annotations

import numpy as np
import pytest

from kvsim.sim.cluster.pd import simulate_pd
from kvsim.sim.cluster.run import simulate_cluster
from kvsim.sim.engine.catalog import ConfigError
from kvsim.sim.engine.config import SimConfig
from kvsim.sim.engine.nixl import BlockBytes, KVTransfer
from kvsim.workloads.request import Request, Workload

BLOCK_BYTES = 2 * 1024 * 1024  # llama-3-8b, block 16
READ7 = KVTransfer(BlockBytes(BLOCK_BYTES)).seconds(7)  # a 100-token prompt: 7 blocks


def _workload(arrivals, prompts=None, prompt=100, output=5) -> Workload:
    reqs = []
    for i, t in enumerate(arrivals):
        toks = prompts[i] if prompts is not None else np.arange(i * 1000, i * 1000 + prompt, dtype=np.int32)
        reqs.append(Request(id=f"r{i}", arrival=t, prompt_len=len(toks), output_len=output, _prompt=toks))
    return Workload.from_list(reqs)


def _cfg(**kw) -> SimConfig:
    return SimConfig(block_size=16, **({"model": "llama-3-8b", "num_gpu_blocks": 64, "prefill_replicas": 1,
                                        "decode_replicas": 1} | kw)).validate()


def test_one_requests_path_through_both_pools_by_hand():
    # (worked for the sync scheduler; test_a_decode_replica_reading_alone_is_the_lone_decode_side
    # checks the async one's decode replica against the lone decode side, which conforms to vLLM)
    r = simulate_pd(_workload([0.0, 0.01, 0.02]), _cfg(async_scheduling=False))
    p = r.paths.set_index("id")
    prefill_steps = r.replicas[0].steps
    decode_steps = r.replicas[1].steps
    # r0: prefilled alone (one step, its one token), then read at once by the idle decode replica,
    # which promotes it when the read ends; the prefill replica, idle, frees its blocks then too
    first_end = prefill_steps["time"].iloc[0] + prefill_steps["duration"].iloc[0]
    assert p.at["r0", "prefill_done"] == first_end
    assert p.at["r0", "read_post"] == first_end
    assert p.at["r0", "read_end"] == pytest.approx(first_end + READ7, abs=1e-12)
    assert p.at["r0", "decode_start"] == p.at["r0", "read_end"] == p.at["r0", "released"]
    assert list(r.replicas[0].requests["output_tokens"]) == [1, 1, 1]  # the prefill side's max_tokens 1
    # r1 reaches the decode replica while it decodes r0: admitted (its read posted) at the next step's
    # start; seen by the first step starting once the read ended, promoted when that step ends
    dt = decode_steps["time"].to_numpy()
    ends = dt + decode_steps["duration"].to_numpy()
    k = int(np.searchsorted(dt, p.at["r1", "prefill_done"]))
    assert p.at["r1", "read_post"] == dt[k]
    assert p.at["r1", "read_end"] == pytest.approx(dt[k] + READ7, abs=1e-12)
    seen = int(np.searchsorted(dt, p.at["r1", "read_end"]))
    assert p.at["r1", "decode_start"] == ends[seen]
    # the prefill replica runs r2 meanwhile (0.02 to its step's end): it polls r1's release only
    # when that step ends, then frees r1's blocks
    assert p.at["r1", "released"] == p.at["r2", "prefill_done"]
    # TTFT's parts add up
    for rid in ("r0", "r1", "r2"):
        parts = p.loc[rid, ["prefill_queue", "prefill", "decode_queue", "transfer", "promotion"]].sum()
        first = p.at[rid, "first_token"] - p.at[rid, "decode_start"]
        assert p.at[rid, "ttft"] == pytest.approx(parts + first, abs=1e-12)
    s = r.summary["pd"]
    assert (s["requests"], s["finished"], s["remote"], s["read_bytes"]) == (3, 3, 3, 21 * BLOCK_BYTES)


def test_a_hybrid_requests_read_is_each_groups_blocks_past_the_hit_by_hand():
    # gpt-oss-20b, block 16: a sliding-window group (128 tokens) and a full-attention one, 12 layers
    # each; a pool block is 12 pages of 8 KV heads x 64 x K and V x 2 bytes x 16 tokens. A 1000-token
    # prompt: full attention reads cdiv(1000, 16) = 63 blocks, the window 63 - (1000 - 128 + 1) // 16
    # = 9 (vLLM's get_unhashed_block_ids_all_groups, clipped to cdiv(128, 16) + 1 = 9 by
    # get_exchange_clipped_blocks): 72 blocks, each read across all 12 layers
    block = 12 * 8 * 64 * 2 * 2 * 16
    cfg = SimConfig(model="gpt-oss-20b", block_size=16, num_gpu_blocks=400, prefill_replicas=1, decode_replicas=1,
                    async_scheduling=False)  # (its release worked for the sync scheduler)
    r = simulate_pd(_workload([0.0], prompt=1000), cfg.validate())
    p = r.paths.set_index("id")
    assert p.at["r0", "read_bytes"] == 72 * block == r.summary["pd"]["read_bytes"]
    assert p.at["r0", "read_end"] == pytest.approx(p.at["r0", "read_post"] + KVTransfer(BlockBytes(block)).seconds(72), abs=1e-12)
    assert p.at["r0", "released"] == p.at["r0", "read_end"]  # the prefill replica, idle, frees then
    # it held its window's 9 blocks (the 54 out of the window went at its finish) and its 63
    held = r.replicas[0].summary["held_block_seconds"]
    assert held == pytest.approx(72 * (p.at["r0", "released"] - p.at["r0", "prefill_done"]), rel=1e-12)


def test_a_mamba_hybrid_runs_as_a_pd_cluster():
    # qwen3-next-80b-a3b at TP 8 on H100s (blocks of 192): the prefill replica computes 999 of a
    # 1,000-token prompt (`_prefill_backoff` 1), the decode replica reads them: cdiv(999, 192) = 6
    # attention blocks + one state block for each of the 3 Mamba groups (base_scheduler.py
    # `get_exchange_clipped_blocks`, `clip_ssm_state_blocks`), then computes the last prompt token
    # Each attention block weighs a pool block, 12 pages of 196,608 bytes; each state block only its 12
    # layer slots' conv and SSM state, 12 x 137,216 (nixl/base_worker.py `_build_mamba_local`,
    # `_build_mamba_remote`; ssm_conv_transfer_utils.py `derive_mamba_conv_split`'s `ssm_sizes`):
    # 6 x 2,359,296 + 3 x 1,646,592 = 19,095,552 bytes a rank, read alone on the link in
    # 5e-5 + 19,095,552 / 25e9 = 0.00081382208 s (as 9 pool blocks: 21,233,664 bytes, 0.00089934656 s)
    cfg = SimConfig(model="qwen3-next-80b-a3b", tensor_parallel=8, gpu="h100-sxm", prefill_replicas=1,
                    decode_replicas=1)
    r = simulate_pd(_workload([0.0], prompt=1000), cfg.validate())
    p = r.paths.set_index("id")
    assert r.replicas[1].summary["kv_bytes_per_block"] == 12 * 196_608
    assert p.at["r0", "read_bytes"] == 6 * 12 * 196_608 + 3 * 12 * 137_216 == 19_095_552 == r.summary["pd"]["read_bytes"]
    assert p.at["r0", "read_end"] - p.at["r0", "read_post"] == pytest.approx(5e-5 + 19_095_552 / 25e9, abs=1e-12)
    assert r.replicas[1].summary["read_tokens"] == 999 and r.replicas[1].summary["finished"] == 1


def test_two_reads_from_one_prefill_replica_share_its_nic():
    # both prompts prefill in one step on the one prefill replica and go to two idle decode replicas:
    # their reads start together through the prefill NIC, each at half its bandwidth
    r = simulate_pd(_workload([0.0, 0.0]), _cfg(decode_replicas=2))
    p = r.paths.set_index("id")
    assert p.at["r0", "read_post"] == p.at["r1", "read_post"]
    shared = 5e-5 + 2 * 7 * BLOCK_BYTES / 25e9
    assert p.at["r0", "transfer"] == pytest.approx(shared, rel=1e-12)
    assert p.at["r1", "transfer"] == pytest.approx(shared, rel=1e-12)
    assert sorted(p["decode_replica"]) == [1, 2]


def test_never_disaggregating_is_the_aggregated_cluster_of_the_decode_pool():
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 50, int(n), dtype=np.int32) for n in rng.integers(20, 300, 40)]
    wl = lambda: _workload(sorted(rng.uniform(0, 0.5, 40)), prompts)  # noqa: E731
    arrivals_wl = wl()
    reqs = list(arrivals_wl)
    for run_async in (False, True):
        agg = simulate_cluster(Workload.from_list(reqs), SimConfig(
            model="llama-3-8b", block_size=16, num_gpu_blocks=64, replicas=2, router="round-robin",
            async_scheduling=run_async).validate())
        pdr = simulate_pd(Workload.from_list(reqs), _cfg(decode_replicas=2, pd_decider="never",
                                                         async_scheduling=run_async))
        _same_decode_pool(agg, pdr)


def _same_decode_pool(agg, pdr) -> None:
    assert not pdr.paths["remote"].any()
    cols = ["id", "arrival", "first_scheduled", "first_token", "finish", "hit_tokens", "output_tokens", "status"]
    for i in range(2):
        assert agg.replicas[i].requests[cols].equals(pdr.replicas[1 + i].requests[cols])
    assert len(pdr.replicas[0].requests) == 0


def test_llmd_decider_keeps_prompts_the_decode_replica_holds_local():
    # llm-d routing and decider: a first prompt is not cached anywhere (disaggregated); the same
    # prompt again goes to the decode replica that holds it (prefix scorer), whose non-cached suffix
    # (< 16 tokens) keeps it local
    base = np.arange(160, dtype=np.int32)
    r = simulate_pd(_workload([0.0, 1.0], [base, base]), _cfg(router="llm-d", pd_decider="llm-d"))
    p = r.paths.set_index("id")
    assert p.at["r0", "remote"] and not p.at["r1", "remote"]
    assert p.at["r1", "cached_tokens"] == 160
    # behind a router with no prefix index llm-d never disaggregates (computeNonCachedTokens not ok)
    rr = simulate_pd(_workload([0.0, 1.0], [base, base]), _cfg(router="round-robin", pd_decider="llm-d"))
    assert not rr.paths["remote"].any()


@pytest.mark.parametrize("kw, field", [
    ({"prefill_replicas": 1, "decode_replicas": 0}, "needs both pools"),
    ({"pd_decider": "maybe"}, "pd_decider must be"),
    ({"replicas": 2}, "replicas"),
    ({"preemption": "swap", "num_cpu_blocks": 8}, "swap preemption"),
    ({"prefill_replicas": -1}, "prefill_replicas must be"),
])
def test_bad_pd_settings_are_refused_in_one_line(kw, field):
    with pytest.raises(ConfigError, match=field) as e:
        SimConfig(model="llama-3-8b", **({"prefill_replicas": 1, "decode_replicas": 1} | kw)).validate()
    assert "\n" not in str(e.value)


def test_kvsim_run_writes_a_pd_clusters_folder(tmp_path):
    import json

    import pandas as pd
    from typer.testing import CliRunner

    from kvsim.sim.cli.app import app
    from kvsim.workloads.jsonl import write_jsonl

    trace = tmp_path / "t.jsonl"
    write_jsonl(list(_workload([0.0, 0.01, 0.02])), trace)
    out = tmp_path / "run"
    r = CliRunner().invoke(app, ["run", str(trace), "--model", "llama-3-8b", "--num-gpu-blocks", "64",
                                 "--prefill-replicas", "1", "--decode-replicas", "1", "--slo-ttft", "1",
                                 "--decode-pool", "tensor_parallel=2", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert ("on llama-3-8b: 1 prefill (h100-sxm x1, 64 blocks) + 1 decode (h100-sxm x2, 64 blocks) replicas"
            in r.output)
    assert "finished 3, disaggregated 3" in r.output
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["pd"]["requests"], summary["pd"]["remote"], summary["pd"]["slo_attainment"]) == (3, 3, 1.0)
    paths = pd.read_parquet(out / "paths.parquet")
    # the decode rank's half of each block (TP 2)
    assert list(paths["id"]) == ["r0", "r1", "r2"] and paths["read_bytes"].tolist() == [7 * BLOCK_BYTES // 2] * 3
    assert json.loads((out / "config.json").read_text())["decode_pool"] == "tensor_parallel=2"
    # each duration in the unit a person reads, as the tables have them (`sim.studies.units.seconds`)
    from kvsim.sim.cli.report import pd_lines

    slow = {**summary, "pd": {**summary["pd"], "ttft_p50": 200.0, "ttft_p99": 7200.0, "tpot_p50": 0.0092}}
    assert pd_lines(slow)[2].startswith("  TTFT p50 3.3 min, p99 2.0 h; TPOT p50 9.2 ms, p99 ")
    assert (out / "pd.png").is_file() and (out / "replica-0" / "summary.json").is_file()
    # kvsim report prints the figures again; kvsim compare sets P/D runs side by side
    again = CliRunner().invoke(app, ["report", str(out), "--no-plots"])
    assert again.exit_code == 0, again.output
    assert again.output.splitlines() == r.output.splitlines()[:len(again.output.splitlines())]
    both = CliRunner().invoke(app, ["compare", str(out), str(out)])
    assert both.exit_code == 0, both.output
    header, row = both.output.splitlines()[:2]
    assert header.split()[:6] == ["run", "prefill", "decode", "router", "decider", "requests"]
    assert row.split()[:11] == ["run", "1", "x", "h100-sxm", "TP1", "1", "x", "h100-sxm", "TP2", "round-robin",
                                "always"]
    lone = tmp_path / "lone"
    assert CliRunner().invoke(app, ["run", str(trace), "--num-gpu-blocks", "64", "--no-plots", "--out",
                                    str(lone)]).exit_code == 0
    mixed = CliRunner().invoke(app, ["compare", str(out), str(lone)])
    assert mixed.exit_code != 0 and "not a P/D run folder; compare P/D runs with P/D runs" in mixed.output
    bad = CliRunner().invoke(app, ["run", str(trace), "--prefill-replicas", "1", "--out", str(tmp_path / "x")])
    assert bad.exit_code != 0 and "needs both pools" in bad.output and not (tmp_path / "x").exists()


@pytest.mark.parametrize("router, decider, run_async", [("llm-d", "always", False), ("llm-d", "llm-d", False),
                                                        ("dynamo", "dynamo", False), ("round-robin", "always", False),
                                                        ("llm-d", "llm-d", True), ("dynamo", "dynamo", True)])
def test_the_speed_shortcuts_change_nothing(router, decider, run_async, monkeypatch):
    """Lazy decodes, the blocked head and quiet runs stay on with the NIXL connector (quiet runs beside
    reads in flight too, each stopping before a step whose poll could see one done; the async output
    takes no quiet runs): every request's way is the same with them off."""
    from kvsim.sim.engine.quiet import QuietRuns

    beside = []  # quiet runs that began while their connector had reads or holds in flight
    run = QuietRuns.run

    def counted(self, *a):
        conn = self.sched.connector
        beside.append(conn is not None and conn.has_work())
        return (yield from run(self, *a))

    monkeypatch.setattr(QuietRuns, "run", counted)
    rng = np.random.default_rng(11)
    shared = rng.integers(0, 50, 64, dtype=np.int32)
    prompts = [np.concatenate([shared, rng.integers(0, 50, int(n), dtype=np.int32)]) for n in rng.integers(10, 200, 60)]
    arrivals = sorted(rng.uniform(0, 0.4, 60))
    runs = [simulate_pd(_workload(arrivals, prompts, output=int(o)), _cfg(decode_replicas=2, num_gpu_blocks=48,
                                                                         router=router, pd_decider=decider,
                                                                         shortcuts=on, async_scheduling=run_async))
            for on, o in ((True, 40), (False, 40))]
    cols = [c for c in runs[0].paths.columns if c != "cached_tokens"]
    assert runs[0].paths[cols].equals(runs[1].paths[cols])
    assert runs[0].paths["status"].eq("finished").all()
    # the path under test was taken (Dynamo's replicas too: KV events keep them)
    assert (sum(beside) > 0) if not run_async else not beside


def test_dynamo_decides_from_the_hottest_decode_overlap_and_picks_decode_after_the_prefill():
    # Dynamo's IslBounding: a first 100-token prompt has no overlap anywhere (ratio 1.0 >= 0.7):
    # disaggregated, its decode replica picked once the prefill is done; the same prompt a second later
    # overlaps 96 tokens on the replica that decoded it (KV events): eff_isl 4 < 2048 and 0.04 < 0.7, local
    base = np.arange(100, dtype=np.int32)
    r = simulate_pd(_workload([0.0, 1.0], [base, base]), _cfg(decode_replicas=2, router="dynamo", pd_decider="dynamo"))
    p = r.paths.set_index("id")
    assert p.at["r0", "remote"] and not p.at["r1", "remote"]
    assert p.at["r0", "cached_tokens"] == 0 and p.at["r1", "cached_tokens"] == 96
    assert p.at["r1", "decode_replica"] == p.at["r0", "decode_replica"]  # Dynamo's KV router follows the overlap


def test_each_pools_router_sees_the_time_of_its_pick(monkeypatch):
    # a router that reads the view's clock (sglang's cache-aware router evicts by it) sees the time of
    # the pick: the decode pick at the arrival (llm-d's order), the prefill pick right after it
    from kvsim.sim.cluster import routers

    seen = []
    pick = routers.RoundRobin.pick
    monkeypatch.setattr(routers.RoundRobin, "pick",
                        lambda self, req, view: seen.append((req.id, view.now)) or pick(self, req, view))
    simulate_pd(_workload([0.0, 0.25, 0.5]), _cfg(router="round-robin", pd_decider="always"))
    assert seen == [("r0", 0.0), ("r0", 0.0), ("r1", 0.25), ("r1", 0.25), ("r2", 0.5), ("r2", 0.5)]


def test_dynamo_load_keeps_a_prompt_local_while_its_prefill_replica_is_busy():
    # Dynamo's PrefillLoad, busy = the prefill router's active prefill tokens on its peeked worker >
    # pd_busy_threshold x max_num_batched_tokens (8,192 on an H100: 0.01 x 8192 = 81.92 tokens).
    # r0 (100 tokens) finds the prefill replica calm and goes remote; r1, at the same time, finds r0's
    # 100 tokens still counted (no first token yet): busy, so local; r2, a second later, calm again.
    cfg = _cfg(router="dynamo", pd_decider="dynamo-load", pd_busy_threshold=0.01)
    assert cfg.pool_config("prefill").batch_limits()[0] == 8192
    r = simulate_pd(_workload([0.0, 0.0, 1.0]), cfg)
    assert r.paths["remote"].tolist() == [True, False, True]
    assert r.paths["status"].tolist() == ["finished"] * 3
    # with no threshold there is no signal: calm, every prompt remote
    calm = simulate_pd(_workload([0.0, 0.0, 1.0]), cfg.replace(pd_busy_threshold=None))
    assert calm.paths["remote"].tolist() == [True, True, True]


@pytest.mark.parametrize("run_async, model, tp", [(False, "llama-3-8b", 1), (True, "llama-3-8b", 1),
                                                  (True, "gpt-oss-20b", 1), (True, "qwen3-next-80b-a3b", 4)])
def test_a_decode_replica_reading_alone_is_the_lone_decode_side(run_async, model, tp):
    """A decode replica whose reads never share the link is a lone decode side (`kv_transfer_role`
    "decode", which `kvsim conform --pd` checks against vLLM's NixlConnector) given each request when
    its prefill replica finished it: every request's schedule, first token and finish the same, with
    the sync output and the async (whose schedules poll the link at their batch's start, once every
    other replica has reached it: `ReplicaFront.ahead`)."""
    from kvsim.sim.engine.run import simulate

    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 50, int(n), dtype=np.int32) for n in rng.integers(40, 400, 24)]
    arrivals = [0.05 * i for i in range(24)]  # one read at a time: a read takes under 5 ms
    cfg = _cfg(model=model, tensor_parallel=tp, num_gpu_blocks=400, async_scheduling=run_async)
    r = simulate_pd(_workload(arrivals, prompts, output=30), cfg)
    p = r.paths.set_index("id")
    assert p["remote"].all() and p["status"].eq("finished").all()
    assert ((p["read_end"] - p["read_post"]) < 0.005).all()
    assert (p["read_post"].iloc[1:].to_numpy() > p["read_end"].iloc[:-1].to_numpy()).all()  # never together
    reached = [Request(id=f"r{i}", arrival=float(p.at[f"r{i}", "prefill_done"]), prompt_len=len(prompts[i]),
                       output_len=30, _prompt=prompts[i]) for i in range(24)]
    lone = simulate(Workload.from_list(reached), SimConfig(model=model, tensor_parallel=tp, block_size=16,
                                                           num_gpu_blocks=400, kv_transfer_role="decode",
                                                           async_scheduling=run_async).validate())
    cols = ["id", "arrival", "first_scheduled", "first_token", "finish", "hit_tokens", "output_tokens", "status"]
    assert lone.requests[cols].equals(r.replicas[1].requests[cols])
    assert lone.steps.equals(r.replicas[1].steps)


def test_async_replicas_ask_the_link_only_once_every_earlier_event_happened(monkeypatch):
    """Under async output a replica schedules its next batch at that batch's start, ahead of SimPy's
    clock, and its schedule polls and posts reads on the shared link; a read another replica starts
    before then moves this one's end, so it first lets every event before that start happen
    (`ReplicaFront.ahead`). Without that wait this cluster asks the link about a time and then starts a
    read before it ("read ... starts ... before the link's time"). Deterministic, every request done."""
    from kvsim.sim.cluster import pd as pd_module

    early = []
    transport = pd_module.ClusterTransport
    post, read_end, release_at = transport.post, transport.read_end, transport.release_at

    def watched(f, t_arg):
        def call(self, *a):
            early.append(self.pd.env.peek() < a[t_arg])  # an event still due before the time asked about
            return f(self, *a)
        return call

    monkeypatch.setattr(transport, "post", watched(post, 3))
    monkeypatch.setattr(transport, "read_end", watched(read_end, 1))
    monkeypatch.setattr(transport, "release_at", watched(release_at, 4))
    rng = np.random.default_rng(11)
    shared = rng.integers(0, 50, 64, dtype=np.int32)
    prompts = [np.concatenate([shared, rng.integers(0, 50, int(n), dtype=np.int32)]) for n in rng.integers(10, 200, 200)]
    arrivals = sorted(rng.uniform(0, 0.4, 200))
    cfg = _cfg(prefill_replicas=2, decode_replicas=2, num_gpu_blocks=48, router="round-robin", pd_decider="always")
    assert cfg.runs_async
    runs = [simulate_pd(_workload(arrivals, prompts, output=40), cfg) for _ in range(2)]
    assert runs[0].paths.equals(runs[1].paths)
    assert runs[0].paths["status"].eq("finished").all() and runs[0].paths["remote"].all()
    assert len(early) > 1000 and not any(early)
