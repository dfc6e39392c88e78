"""`import kvsim`: the public Python API (kvsim/__init__.py, sim/api.py).

Each call is checked against the path it wraps (the engine's `simulate`, the commands' defaults),
so the API cannot drift from `kvsim run`; one test imports kvsim from a folder that holds a user's
own `workloads.py`, `sim.py` and `gpu.py`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import version

import pandas as pd
import pytest

import kvsim
from kvsim.sim.studies.run_folder import load_run

SHAPE = {"num_requests": 40, "rate": 4.0, "seed": 1}  # a small multi-turn workload


@pytest.fixture(scope="module")
def chat() -> kvsim.Workload:
    return kvsim.generate_workload("multi-turn", **SHAPE)


def test_the_default_run_is_kvsim_runs_quick_start():
    # README quick start: `kvsim run` on the embedded workload, 512 blocks: 64.75 %, 5,486 evictions
    run = kvsim.simulate()
    assert run.config.num_gpu_blocks == 512
    assert (run.summary["requests"], run.summary["evictions"]) == (300, 5486)
    assert run.summary["hit_rate"] == pytest.approx(0.6475123672296172, abs=0)
    assert len(run.requests) == 300 and len(run.steps) == run.summary["steps"]


def test_a_user_folder_with_its_own_workloads_sim_and_gpu_modules_does_not_shadow_kvsim(tmp_path):
    for name in ("workloads", "sim", "gpu", "kvcache"):
        (tmp_path / f"{name}.py").write_text("raise ImportError('the user module was imported')\n")
    code = ("import kvsim, json; r = kvsim.simulate(num_gpu_blocks=300); "
            "print(json.dumps([r.summary['requests'], r.summary['evictions']]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == [300, kvsim.simulate(num_gpu_blocks=300).summary["evictions"]]


def test_an_unknown_setting_names_the_closest_field():
    with pytest.raises(kvsim.ConfigError, match=r"^unknown setting 'num_gpu_block'; did you mean 'num_gpu_blocks'\?"):
        kvsim.simulate(num_gpu_block=3)
    with pytest.raises(kvsim.ConfigError, match="block_size must be a positive power of two, got 12"):
        kvsim.config(block_size=12)
    assert kvsim.config(tensor_parallel_size=2).tensor_parallel == 2  # vLLM's name


def test_a_knob_that_would_change_nothing_is_refused():
    """`config.idle_field`, as the commands check their options: one engine routes nothing, a cluster
    without P/D pools decides nothing, no host tier offloads nothing; each is refused, not ignored."""
    fleets = r" \(kvsim.simulate_cluster and kvsim.simulate_pd run fleets\)$"
    with pytest.raises(kvsim.ConfigError, match=r"^router changes nothing without replicas: set it, or leave "
                                                r"router out" + fleets):
        kvsim.simulate(router="llm-d")
    with pytest.raises(kvsim.ConfigError, match=r"^kv_event_delay changes nothing without replicas"):
        kvsim.simulate(kv_event_delay=0.01)
    with pytest.raises(kvsim.ConfigError, match=r"^pd_threshold changes nothing without prefill_replicas: set it, "
                                                r"or leave pd_threshold out$"):
        kvsim.simulate_cluster(replicas=2, pd_threshold=32)
    with pytest.raises(kvsim.ConfigError, match=r"^kv_transfer_gbps changes nothing without prefill_replicas or "
                                                r"kv_transfer_role"):
        kvsim.simulate_cluster(replicas=2, kv_transfer_gbps=10.0)
    with pytest.raises(kvsim.ConfigError, match=r"^offload_prompt_only changes nothing without kv_offloading_size"):
        kvsim.simulate(offload_prompt_only=False)
    with pytest.raises(kvsim.ConfigError, match=r"^calibration changes nothing with step_time set \(a fixed step time "
                                                r"replaces the cost model it tunes\): leave one of the two out$"):
        kvsim.simulate(step_time=0.01, calibration="cal.json")
    assert kvsim.simulate_cluster(replicas=1, router="llm-d", num_gpu_blocks=300).summary["cluster"]["replicas"] == 1


def test_one_workload_object_serves_every_call(chat):
    run = kvsim.simulate(chat, num_gpu_blocks=128)
    assert run.config.num_gpu_blocks == 128 and run.summary["requests"] == 40
    sweep = kvsim.sweep(chat, grid={"num_gpu_blocks": [128, 256]}, workers=2)
    assert sweep["num_gpu_blocks"].tolist() == [128, 256]
    assert sweep["hit_rate"].iloc[0] == run.summary["hit_rate"]
    sim = kvsim.curve(chat, capacities=[128], mode="sim")
    assert sim["hit_rate"].tolist() == [run.summary["hit_rate"]]
    replay = kvsim.curve(chat, capacities=[128, 256], policies=["lru", "arc"], workers=2)
    assert replay[["policy", "capacity"]].values.tolist() == [["lru", 128], ["lru", 256], ["arc", 128], ["arc", 256]]
    alone = kvsim.cache_replay(chat, num_blocks=256)
    assert alone["hit_rate"] == replay["hit_rate"].iloc[1]


def test_a_list_of_requests_and_a_path_are_workloads_too(chat, tmp_path):
    from kvsim.workloads.jsonl import write_jsonl

    reqs = list(chat)
    path = tmp_path / "chat.jsonl"
    write_jsonl(reqs, path)
    want = kvsim.simulate(chat, num_gpu_blocks=128).summary["hit_rate"]
    assert kvsim.simulate(reqs, num_gpu_blocks=128).summary["hit_rate"] == want
    assert kvsim.simulate(path, num_gpu_blocks=128).summary["hit_rate"] == want
    assert kvsim.simulate(kvsim.load_workload(path), num_gpu_blocks=128).summary["hit_rate"] == want
    # in another process the list travels with the point
    assert kvsim.sweep(reqs, grid={"num_gpu_blocks": [128, 64]}, workers=2)["hit_rate"].iloc[0] == want


def test_a_run_writes_a_run_folder_that_the_commands_read(chat, tmp_path):
    run = kvsim.simulate(chat, num_gpu_blocks=128)
    folder = run.write(tmp_path / "run", plots=False)
    back = load_run(folder)
    assert back.summary["hit_rate"] == run.summary["hit_rate"]
    assert back.requests.equals(run.requests)


def test_the_sweep_of_the_default_workload_uses_kvsim_runs_cache():
    df = kvsim.sweep(grid={"eviction": ["lru"]})
    assert df[["eviction", "num_gpu_blocks", "evictions"]].values.tolist() == [["lru", 512, 5486]]


def test_the_version_is_the_installed_distributions():
    assert kvsim.__version__ == version("kvsim")


def test_a_sweep_takes_points_that_are_not_a_product(chat):
    pts = [{"block_size": 16, "num_gpu_blocks": 129}, {"block_size": 32, "num_gpu_blocks": 65}]
    df = kvsim.sweep(chat, points=pts)
    assert df[["block_size", "num_gpu_blocks"]].values.tolist() == [[16, 129], [32, 65]]
    assert df["hit_rate"].tolist() == [kvsim.simulate(chat, **p).summary["hit_rate"] for p in pts]
    with pytest.raises(kvsim.ConfigError, match="^sweep takes a grid or a list of points"):
        kvsim.sweep(chat)
    with pytest.raises(kvsim.ConfigError, match=r"^sweep point \{'block_size': 12\}: block_size must be a positive"):
        kvsim.sweep(chat, grid={"block_size": [16, 12]})


def test_a_sweep_over_replicas_simulates_the_clusters(chat):
    df = kvsim.sweep(chat, grid={"replicas": [1, 2], "router": ["session-affinity"]}, num_gpu_blocks=64)
    lone = kvsim.simulate(chat, num_gpu_blocks=64).summary
    section = kvsim.simulate_cluster(chat, num_gpu_blocks=64, replicas=2, router="session-affinity").summary["cluster"]
    assert df["hit_rate"].tolist() == [lone["hit_rate"], section["overall"]["hit_rate"]]
    assert df.loc[1, "imbalance_mean"] == section["imbalance_mean"] and pd.isna(df.loc[0, "imbalance_mean"])
    assert df.loc[0, "evictions"] == lone["evictions"]


def test_workload_stats_give_the_ideal_hit_rate(chat):
    from kvsim.workloads.stats import describe

    st = kvsim.workload_stats(chat, 16)
    assert st.requests == 40 and st.ideal_token_hit_rate == describe(chat, 16).ideal_token_hit_rate


def test_cache_replay_of_a_model_mixing_layer_kinds_runs_in_its_hybrid_groups():
    """kvsim.cache_replay / `kvsim cache-replay --model`: the groups `kvsim run` keeps the model in
    (the manager conformance mode checks this replay against vLLM's KVCacheManager); the fallback
    is one group keeping every token, as a model without windows."""
    from kvsim.sim.conform.check import hybrid_layers, kvsim_manager
    from kvsim.sim.engine.cost_model import CostModel

    wl = list(kvsim.default_workload())
    groups = kvsim.cache_replay(wl, num_blocks=2100, model="gemma-3-27b")
    cost = CostModel.from_config(kvsim.config(model="gemma-3-27b"))
    same = kvsim_manager(wl, block_size=16, num_blocks=2100, max_running=1, enable_caching=True,
                         vllm_version="0.33", layers=hybrid_layers(cost))
    assert groups["hit_tokens"] == sum(r["hit_tokens"] for r in same) == 94_704
    fallback = kvsim.cache_replay(wl, num_blocks=2100, model="gemma-3-27b", disable_hybrid_kv_cache_manager=True)
    assert fallback["hit_tokens"] == kvsim.cache_replay(wl, num_blocks=2100)["hit_tokens"]
    # Qwen3-Next: its raised block size (320 tokens at TP 4), 42.44% of the default workload's prompt tokens
    nxt = kvsim.cache_replay(wl, num_blocks=200, model="qwen3-next-80b-a3b", tensor_parallel=4)
    assert nxt["hit_tokens"] == 68_800
    curve = kvsim.curve(wl, capacities=[2100], model="gemma-3-27b")  # its replay mode too
    assert curve["hit_rate"].tolist() == [groups["hit_rate"]]
    # fragmentation sampled as each request is freed, as for one group (the pool's id span: its
    # seven groups' blocks; the last block's empty slots, the same as one group's)
    assert curve[["mean_id_fragmentation", "mean_internal_fragmentation"]].values.tolist() == [
        [1685.1133333333332, 6.816666666666666]]


def test_kv_events_are_asked_for_by_their_knob(chat):
    plain = kvsim.simulate(chat, num_gpu_blocks=128)
    run = kvsim.simulate(chat, num_gpu_blocks=128, kv_events=True)
    assert plain.kv_events is None and run.summary == {**plain.summary}
    kinds = [e.as_dict()["type"] for batch in run.kv_events for e in batch.events]
    assert (len(run.kv_events), kinds.count("BlockStored"), kinds.count("BlockRemoved")) == (492, 584, 929)
    assert kinds.count("BlockRemoved") == plain.summary["evictions"]
