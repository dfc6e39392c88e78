"""The whole default run, recorded and verified on the CPU (torch kernels): every step, 0 mismatches.

This is CI's end-to-end check of the op contract: `kvsim run --record-ops` on the embedded
workload, then `kvsim gpu-replay --device cpu`, as a user would type them.
"""

import json

import pytest
from typer.testing import CliRunner

from kvsim.sim.cli.app import app

runner = CliRunner()
# Past the first test (the default run as typed), replays run on one layer of one 8-dim KV head: every
# token, step and op is verified the same (the counts do not depend on the storage's shape), in a
# third to a half of the time of the default 2 layers x 2 heads x 16 dims.
SMALL = ["--layers", "1", "--kv-heads", "1", "--head-dim", "8"]


def test_default_run_verifies_with_zero_mismatches(tmp_path):
    run = tmp_path / "run"
    r = runner.invoke(app, ["run", "--record-ops", "--no-plots", "-o", str(run)])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["gpu-replay", str(run), "--device", "cpu", "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["kernels"] == "torch" and rep["mismatches"] == 0 and rep["first_mismatches"] == []
    assert rep["steps"] == rep["steps_checked"] == 9707
    assert rep["tokens_verified"] == 28_048_648 and rep["sequence_checks"] == 41_101
    assert rep["ops"] == {"write": 44_517, "table": 12_992, "free": 9_440, "evict": 5_486}


def test_a_clusters_replicas_record_their_ops_and_verify(tmp_path):
    """`kvsim run --replicas 2 --record-ops`: each replica's folder holds its op stream, which replays
    on the CPU with 0 mismatches; the two replicas' ops add up to what they ran."""
    out = tmp_path / "c"
    r = runner.invoke(app, ["run", "--replicas", "2", "--router", "round-robin", "--num-gpu-blocks", "256",
                            "--record-ops", "--no-plots", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "load.parquet", "received.parquet",
                                                     "replica-0", "replica-1", "summary.json"]
    writes = 0
    for i in range(2):
        folder = out / f"replica-{i}"
        assert (folder / "ops.parquet").is_file() and (folder / "op_tokens.parquet").is_file()
        got = _verified(folder)
        assert got["steps"] > 1000
        writes += got["ops"]["write"]
    assert writes > 20_000


def test_a_decode_sides_reads_are_recorded_and_verify(tmp_path):
    """`kvsim run --kv-transfer-role decode --record-ops` (every prompt read from a prefill side): each
    read's tokens are recorded as written into their blocks when it is applied
    (`KVCacheManager.record_loaded`), so the replay holds and verifies that KV: 0 mismatches (without
    them it found every read token missing)."""
    run = tmp_path / "dec"
    r = runner.invoke(app, ["run", "--kv-transfer-role", "decode", "--record-ops", "--no-plots", "-o", str(run)])
    assert r.exit_code == 0, r.output
    summary = json.loads((run / "summary.json").read_text())
    rep = _verified(run)
    assert rep["steps"] > 1000
    assert summary["read_tokens"] > 10_000 and rep["tokens_verified"] > summary["read_tokens"]


def test_a_pd_clusters_replicas_record_their_ops_and_verify(tmp_path):
    """`kvsim run --prefill-replicas 1 --decode-replicas 2 --record-ops`: the prefill replica's stream
    and each decode replica's (its reads recorded as written when applied) replay on the CPU with 0
    mismatches."""
    out = tmp_path / "pd"
    r = runner.invoke(app, ["run", "--prefill-replicas", "1", "--decode-replicas", "2", "--record-ops", "--no-plots",
                            "-o", str(out)])
    assert r.exit_code == 0, r.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["pd"]["remote"] == 300
    for i in range(3):
        got = _verified(out / f"replica-{i}")
        assert got["steps"] > 100 and got["tokens_verified"] > 100_000


def _verified(folder) -> dict:
    """`kvsim gpu-replay FOLDER --device cpu` on the small storage: its report, every step checked, 0 mismatches."""
    rep = runner.invoke(app, ["gpu-replay", str(folder), "--device", "cpu", *SMALL, "--json"])
    assert rep.exit_code == 0, rep.output
    got = json.loads(rep.stdout)
    assert got["mismatches"] == 0 and got["steps"] == got["steps_checked"]
    return got


@pytest.mark.parametrize(("model", "tp", "cluster"), [("gpt-oss-20b", "1", True), ("qwen3-next-80b-a3b", "4", False)])
def test_a_hybrid_decode_sides_reads_are_recorded_and_verify(tmp_path, model, tp, cluster):
    """Over vLLM's hybrid groups a decode side records each read group by group
    (`HybridKVCacheManager.record_loaded`: an attention group's loaded blocks, a window's past its null
    ones, a Mamba group's state block): 40 multi-turn requests as a lone decode side (and for gpt-oss-20b
    as a P/D cluster's), every stream replays on the CPU with 0 mismatches (without the reads recorded,
    gpt-oss-20b's default run as a decode side found 25,418,236). (The replay cannot tell a Mamba state
    the read left unrecorded: a decode's state write fills its page whole, checked as written.)"""
    trace = tmp_path / "w.jsonl"
    r = runner.invoke(app, ["workload", "generate", "multi-turn", "-n", "40", "--rate", "2", "--seed", "1", "-o",
                            str(trace)])
    assert r.exit_code == 0, r.output
    knobs = ["--model", model, "--tp", tp, "--record-ops", "--no-plots"]
    lone = tmp_path / "dec"
    r = runner.invoke(app, ["run", str(trace), "--kv-transfer-role", "decode", *knobs, "-o", str(lone)])
    assert r.exit_code == 0, r.output
    read = json.loads((lone / "summary.json").read_text())["read_tokens"]
    assert read > 5_000 and _verified(lone)["tokens_verified"] > read
    if not cluster:
        return
    pd = tmp_path / "pd"
    r = runner.invoke(app, ["run", str(trace), "--prefill-replicas", "1", "--decode-replicas", "1", *knobs, "-o", str(pd)])
    assert r.exit_code == 0, r.output
    for i in range(2):
        assert _verified(pd / f"replica-{i}")["steps"] > 10
