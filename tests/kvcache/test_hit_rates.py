"""Hit rates against independent counts."""

import itertools
import json
import os
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from kvsim.kvcache.manager import KVCacheManager
from kvsim.kvcache.replay import replay
from kvsim.sim.cli.app import app
from kvsim.workloads.request import make_request
from kvsim.workloads.traces import load_workload

TRACES = Path(os.environ.get("KVSIM_TRACES", Path(__file__).resolve().parents[3] / "shared/traces"))
MOONCAKE = TRACES / "mooncake/conversation_trace.jsonl"


def system_prompt_workload(n=40, prompts=1):
    rng = np.random.default_rng(0)
    systems = [rng.integers(0, 32000, 1000) for _ in range(prompts)]
    return [make_request(f"r{i}", i, np.concatenate([systems[i % prompts], rng.integers(0, 32000, 300)]), 50)
            for i in range(n)]


def test_shared_system_prompt_with_ample_capacity():
    recs = []
    res = replay(system_prompt_workload(), KVCacheManager(10_000, 16), on_record=recs.append)
    assert [r.hit_tokens for r in recs] == [0] + [992] * 39
    assert res.evicted_blocks == 0


def test_lru_keeps_the_shared_prefix_under_pressure():
    # 90 usable blocks, 85 per request: tail-first freeing evicts the unique
    # suffixes first, so the whole system prompt survives every request
    recs = []
    res = replay(system_prompt_workload(), KVCacheManager(91, 16), on_record=recs.append)
    assert [r.hit_tokens for r in recs] == [0] + [992] * 39
    assert res.evicted_blocks > 0


def test_small_capacity_lowers_the_rate_and_counts_evictions():
    # two alternating system prompts need 62 * 2 + 23 blocks to both stay cached
    ample = replay(system_prompt_workload(prompts=2), KVCacheManager(10_000, 16))
    small = replay(system_prompt_workload(prompts=2), KVCacheManager(101, 16))
    assert ample.hit_tokens == 38 * 992
    assert small.hit_tokens < ample.hit_tokens
    assert small.evicted_blocks > 0 and ample.evicted_blocks == 0
    assert small.rejected == 0


@pytest.mark.skipif(not MOONCAKE.exists(), reason="Mooncake trace not available")
def test_mooncake_block_512_hits_match_a_count_over_hash_ids():
    n = 1500
    expected, full_seen = [], set()
    with open(MOONCAKE) as f:
        for line in itertools.islice(f, n):
            r = json.loads(line)
            ids, length = r["hash_ids"], r["input_length"]
            hit = 0
            while hit < (length - 1) // 512 and tuple(ids[: hit + 1]) in full_seen:
                hit += 1
            expected.append(hit * 512)
            full_seen.update(tuple(ids[: j + 1]) for j in range(length // 512))
    recs = []
    wl = itertools.islice(iter(load_workload(MOONCAKE)), n)
    replay(wl, KVCacheManager(1_000_000, 512, track_ids=False), on_record=recs.append)
    assert [r.hit_tokens for r in recs] == expected
    assert sum(expected) > 0


def test_cli_cache_replay_json_and_per_request_output(tmp_path):
    out = tmp_path / "req.jsonl"
    res = CliRunner().invoke(app, ["cache-replay", "--num-blocks", "4000", "--json", "--out", str(out)])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert {"requests", "prompt_tokens", "hit_tokens", "hit_rate", "evicted_blocks", "rejected"} <= set(summary)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == summary["requests"] == 300
    assert set(lines[0]) == {"id", "prompt_tokens", "hit_tokens", "output_tokens", "status", "preemptions"}
    assert sum(x["hit_tokens"] for x in lines) == summary["hit_tokens"]


@pytest.mark.parametrize(("args", "message"), [
    (["--eviction", "lruu"], "unknown eviction policy 'lruu'"),
    (["--block-size", "0"], "block_size must be a positive power of two, got 0"),
    (["--num-blocks", "1"], "--num-blocks must be at least 2"),
])
def test_cli_cache_replay_bad_options(args, message):
    res = CliRunner().invoke(app, ["cache-replay", *args])
    assert res.exit_code == 2
    assert message in res.stderr


def test_cli_cache_replay_missing_file_is_a_clear_error(tmp_path):
    res = CliRunner().invoke(app, ["cache-replay", str(tmp_path / "nope.jsonl")])
    assert res.exit_code == 2
    assert f"error: {tmp_path / 'nope.jsonl'}: no such file or directory" in res.stderr


def test_cli_cache_replay_bad_trace_names_file_line_field(tmp_path):
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": -3, "output_length": 5, "hash_ids": [1]}\n')
    res = CliRunner().invoke(app, ["cache-replay", str(bad)])
    assert res.exit_code == 2
    assert f"{bad}:1: field 'input_length'" in res.stderr
