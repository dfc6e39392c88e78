"""`--vllm-version` on every command that takes it, and `kvcache.profiles` itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvsim.kvcache.profiles import RULES, describe, parse_version, profile
from kvsim.sim.cli.app import app

runner = CliRunner()
SHARED = str(Path(__file__).resolve().parents[2] / "golden" / "workloads" / "shared-prefix.jsonl")


def test_profiles_name_each_rule_by_release():
    assert parse_version("v0.33.1") == (0, 33) and profile().version == "0.33"
    assert profile("0.23") == profile("0.23.0")
    old, v27, v28, new = profile("0.23"), profile("0.27"), profile("0.28"), profile("0.33")
    assert (old.free_first(True), v27.free_first(True), v28.free_first(True), new.free_first(True)) == (
        False, True, True, True)
    assert (v27.free_first(False), v28.free_first(False)) == (False, True)
    assert (old.watermark, v28.long_prefill_sole_request, new.long_prefill_sole_request) == (False, False, True)
    assert len(describe()) == len(RULES) and describe()[0].startswith("free_unhashed_first (0.24+; ")
    for bad in ("0.22", "1.0", "latest", "0.33.x"):
        with pytest.raises(ValueError, match="vllm version"):
            profile(bad)


def test_cache_replay_follows_the_release_asked_for():
    # the same sequential replay as tests/golden/shared-prefix-hit-rate at 64 blocks:
    # 0.23's free order gives the curve kvsim had before it matched 0.33
    got = {}
    for v in ("0.23", "0.33"):
        r = runner.invoke(app, ["cache-replay", SHARED, "-n", "64", "--json", "--vllm-version", v])
        assert r.exit_code == 0, r.output
        got[v] = json.loads(r.stdout)["hit_rate"]
    assert got == {"0.23": 0.49730700179533216, "0.33": 0.5068821065230401}


def test_bad_or_impossible_versions_are_one_line_errors(tmp_path: Path):
    cases = [
        (["cache-replay", SHARED, "--vllm-version", "0.5"], "vllm version '0.5' is not modelled"),
        (["run", SHARED, "--vllm-version", "0.23", "--watermark", "0.1", "--out", str(tmp_path / "r")],
         "vLLM 0.23 has no watermark"),
        (["curve", SHARED, "-c", "64", "--vllm-version", "nope", "--out", str(tmp_path / "c")],
         "expected MAJOR.MINOR"),
    ]
    for args, msg in cases:
        r = runner.invoke(app, args)
        assert r.exit_code == 2 and msg in r.output, (args, r.output)
        assert "Traceback" not in r.output
    assert not (tmp_path / "r").exists() and not (tmp_path / "c").exists()


def test_sweep_takes_the_version_for_every_point(tmp_path: Path):
    cfg = tmp_path / "s.toml"
    cfg.write_text(f'[base]\nworkload = "{SHARED}"\nnum_gpu_blocks = 64\nstep_time = 0.05\n'
                   '[grid]\neviction = ["lru"]\n')
    r = runner.invoke(app, ["sweep", str(cfg), "--workers", "1", "--vllm-version", "0.23",
                            "--out", str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    (point,) = (tmp_path / "out" / "points").glob("*.json")
    assert json.loads(point.read_text())["params"]["vllm_version"] == "0.23"
    r = runner.invoke(app, ["sweep", str(cfg), "--vllm-version", "9.9", "--out", str(tmp_path / "bad")])
    assert r.exit_code == 2 and "not modelled" in r.output
