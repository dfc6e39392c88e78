"""The whole default run, recorded and verified on the CPU (torch kernels): every step, 0 mismatches.

This is CI's end-to-end check of the op contract: `kvsim run --record-ops` on the embedded
workload, then `kvsim gpu-replay --device cpu`, as a user would type them.
"""

import json

from typer.testing import CliRunner

from kvsim.sim.cli.app import app

runner = CliRunner()


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
        rep = runner.invoke(app, ["gpu-replay", str(folder), "--device", "cpu", "--json"])
        assert rep.exit_code == 0, rep.output
        got = json.loads(rep.stdout)
        assert got["mismatches"] == 0 and got["steps"] == got["steps_checked"] > 1000
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
    r = runner.invoke(app, ["gpu-replay", str(run), "--device", "cpu", "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["mismatches"] == 0 and rep["steps"] == rep["steps_checked"] > 1000
    assert summary["read_tokens"] > 10_000 and rep["tokens_verified"] > summary["read_tokens"]


def test_a_pd_clusters_replicas_record_their_ops_and_verify(tmp_path):
    """`kvsim run --prefill-replicas 1 --decode-replicas 2 --record-ops`: the prefill replica's stream
    and each decode replica's (its reads recorded as written when applied) replay on the CPU with 0
    mismatches; a hybrid model's decode replicas are refused before the run, nothing written."""
    out = tmp_path / "pd"
    r = runner.invoke(app, ["run", "--prefill-replicas", "1", "--decode-replicas", "2", "--record-ops", "--no-plots",
                            "-o", str(out)])
    assert r.exit_code == 0, r.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["pd"]["remote"] == 300
    for i in range(3):
        rep = runner.invoke(app, ["gpu-replay", str(out / f"replica-{i}"), "--device", "cpu", "--json"])
        assert rep.exit_code == 0, rep.output
        got = json.loads(rep.stdout)
        assert got["mismatches"] == 0 and got["steps"] == got["steps_checked"] > 100 and got["tokens_verified"] > 100_000
    bad = runner.invoke(app, ["run", "--model", "gpt-oss-20b", "--prefill-replicas", "1", "--decode-replicas", "1",
                              "--record-ops", "--no-plots", "-o", str(tmp_path / "x")])
    assert bad.exit_code != 0 and "hybrid KV-cache groups' reads are not recorded yet" in bad.output
    assert not (tmp_path / "x").exists()
