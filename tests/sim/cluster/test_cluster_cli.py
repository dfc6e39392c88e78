"""`kvsim run --replicas N --router NAME` and `kvsim.simulate_cluster`: the cluster's folder, table
and summary agree with the library's result."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pandas.testing as pt
from typer.testing import CliRunner

import kvsim
from kvsim.sim.cli.app import app

runner = CliRunner()


def test_run_a_cluster_writes_its_folder_and_table(tmp_path: Path) -> None:
    out = tmp_path / "c"
    r = runner.invoke(app, ["run", "--replicas", "2", "--router", "least-outstanding", "--router-metrics-interval",
                            "0.1", "--slo-ttft", "0.1", "-o", str(out)])
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0] == ("default (300 requests): 2 replicas of llama-3-8b on h100-sxm x1, KV cache 512 blocks x 16 "
                        "tokens each, eviction lru, async scheduling")
    assert lines[1].split() == ["replica", "requests", "hit", "rate", "TTFT", "p50", "TTFT", "p99", "TPOT", "p50",
                                "TPOT", "p99", "goodput"]
    assert [ln.split()[0] for ln in lines[2:5]] == ["0", "1", "all"]
    api = kvsim.simulate_cluster(replicas=2, router="least-outstanding", router_metrics_interval=0.1, slo_ttft=0.1)
    summary = json.loads((out / "summary.json").read_text())
    assert summary == json.loads(json.dumps(api.summary))
    section = summary["cluster"]
    assert (section["replicas"], section["router"], section["router_metrics_interval"]) == (2, "least-outstanding", 0.1)
    assert [ln.split()[1] for ln in lines[2:5]] == [str(f["requests"]) for f in section["per_replica"]] + ["300"]
    pt.assert_frame_equal(pd.read_parquet(out / "received.parquet"), api.received)
    for i in range(2):
        pt.assert_frame_equal(pd.read_parquet(out / f"replica-{i}" / "requests.parquet"), api.replicas[i].requests)
    assert json.loads((out / "config.json").read_text())["replicas"] == 2
    assert (out / "cluster.png").is_file()
    # `kvsim report` on the cluster's folder prints what `kvsim run` printed and draws cluster.png again
    (out / "cluster.png").unlink()
    rep = runner.invoke(app, ["report", str(out)])
    assert rep.exit_code == 0, rep.output
    table = lines[: lines.index("")]
    assert rep.stdout.splitlines() == [*table, f"wrote {out / 'cluster.png'}"]
    assert (out / "cluster.png").stat().st_size > 10_000
    (out / "load.parquet").write_text("not parquet")
    bad = runner.invoke(app, ["report", str(out)])
    assert bad.exit_code != 0 and f"{out / 'load.parquet'}: not a parquet table" in bad.output
    assert len(bad.output.strip().splitlines()) == 1


def test_a_bad_router_is_one_error_line(tmp_path: Path) -> None:
    r = runner.invoke(app, ["run", "--replicas", "2", "--router", "nearest", "-o", str(tmp_path / "x")])
    assert r.exit_code != 0
    assert "router must be one of round-robin, random, least-outstanding, vllm-dp, vllm-dp-legacy, " \
           "session-affinity, llm-d-precise, dynamo, llm-d, sglang-cache-aware, got 'nearest'" in r.output
    assert not (tmp_path / "x").exists()


def test_simulate_refuses_a_cluster_config() -> None:
    import pytest

    from kvsim.sim.engine.config import ConfigError, SimConfig
    from kvsim.sim.engine.run import simulate

    with pytest.raises(ConfigError, match="replicas 2: a cluster runs through sim.cluster.run.simulate_cluster"):
        simulate([], SimConfig(replicas=2))


def test_bad_router_scorers_are_one_error_line(tmp_path):
    r = runner.invoke(app, ["run", "--replicas", "2", "--router", "llm-d-precise", "--router-scorers", "prefix:2,hits:1",
                            "-o", str(tmp_path / "x")])
    assert r.exit_code != 0
    assert r.output == ("error: router_scorers: expected name:weight with name one of prefix, kv-util, queue, "
                        "got 'hits:1'\n")
    assert not (tmp_path / "x").exists()


# (sync scheduling: the table below is the sync scheduler's)
SMALL = ["--num-gpu-blocks", "40", "--max-num-batched-tokens", "256", "--load", "4", "--slo-ttft", "0.1",
         "--slo-tpot", "0.02", "--no-plots", "--no-async-scheduling"]


def test_compare_sets_a_cluster_beside_a_lone_run(tmp_path: Path, golden_head) -> None:
    """`kvsim compare` given a cluster run folder: a row a run, the cluster's over all its replicas
    and a row each replica under it; --plot (lone runs' overlay) is refused in one line."""
    trace = golden_head("multi-turn.jsonl", 48, "mt48.jsonl")
    for name, extra in (("lone", []), ("c3", ["--replicas", "3", "--router", "vllm-dp"])):
        r = runner.invoke(app, ["run", str(trace), *SMALL, *extra, "-o", str(tmp_path / name)])
        assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["compare", str(tmp_path / "lone"), str(tmp_path / "c3")])
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines() == [
        "run             replicas  requests  hit rate  TTFT p50  TTFT p99  TPOT p50  TPOT p99  goodput    imbalance",
        "lone                   1        48    30.98%   13.0 ms    1.84 s    7.0 ms   12.7 ms   4.06/s            -",
        "c3           3 x vllm-dp        48    40.78%    7.0 ms   25.9 ms    7.0 ms    7.1 ms   7.01/s  2.11 / 3.00",
        "  replica 0                     16    47.34%    7.0 ms   15.9 ms    7.0 ms    7.0 ms   2.34/s",
        "  replica 1                     19    40.14%    7.3 ms   31.1 ms    7.0 ms    7.0 ms   3.13/s",
        "  replica 2                     13    34.50%    7.3 ms   12.3 ms    7.0 ms    7.1 ms   2.28/s",
    ]
    r = runner.invoke(app, ["compare", str(tmp_path / "lone"), str(tmp_path / "c3"), "--plot", str(tmp_path / "x.png")])
    assert (r.exit_code, r.output.strip()) == (
        2, f"error: --plot overlays lone runs; {tmp_path / 'c3'} is a cluster run (its folder has cluster.png)")
    assert not (tmp_path / "x.png").exists()


def test_a_prefix_aware_routers_prediction_is_printed(tmp_path):
    """llm-d's approximate index against the replicas' hits on the default workload (3 replicas of
    200 blocks, sync scheduling): it expected more than it got on 30 requests and less on 56."""
    r = runner.invoke(app, ["run", "--replicas", "3", "--router", "llm-d", "--num-gpu-blocks", "200", "--no-plots",
                            "--no-async-scheduling", "-o", str(tmp_path / "c")])
    assert r.exit_code == 0, r.output
    assert ("its prefix prediction: 108,592 prompt tokens expected to hit, 106,352 hit; more expected than hit on "
            "30 of 300 requests (8,048 tokens), fewer on 56 (5,808)\n") in r.output
    section = json.loads((tmp_path / "c" / "summary.json").read_text())["cluster"]
    assert section["prediction"] == {"requests": 300, "expected_tokens": 108592, "hit_tokens": 106352, "over": 30,
                                     "over_tokens": 8048, "under": 56, "under_tokens": 5808}
