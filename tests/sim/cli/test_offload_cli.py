"""`kvsim cache-replay` and `kvsim curve` with KV offloading's knobs (the ones `kvsim run` takes).

The workload: A (12 tokens), B (12 others), A again, one output token each, at block size 4 in
4 GPU blocks (3 usable): B evicts A from the GPU, and A's return loads its 3 chunks from the
tier (tests/kvcache/test_replay_offload.py traces it). Llama-3-8B's KV is 128 KiB a token, so
a 4-token block is 512 KiB and 1/256 GiB holds 8 chunks."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from kvsim.sim.cli.app import app
from kvsim.workloads import make_request, write_jsonl
from tests.sim.cli.bad_input import assert_one_error, write_files

runner = CliRunner()
EIGHT_CHUNKS = "0.00390625"  # GiB: 8 chunks of one 4-token Llama-3-8B block
ABA = ["-b", "4", "--kv-offloading-size", EIGHT_CHUNKS]


@pytest.fixture
def aba(tmp_path: Path) -> str:
    a, b = list(range(12)), list(range(100, 112))
    path = tmp_path / "aba.jsonl"
    write_jsonl([make_request("A", 0.0, a, 1), make_request("B", 1.0, b, 1), make_request("A2", 2.0, a, 1)], path)
    return str(path)


def replay_json(*args: str) -> dict:
    r = runner.invoke(app, ["cache-replay", *args, "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_cache_replay_loads_the_evicted_prompt_from_the_tier(aba: str, tmp_path: Path) -> None:
    got = replay_json(aba, "-n", "4", *ABA, "-o", str(tmp_path / "recs.jsonl"))
    assert got == dict(
        requests=3, prompt_tokens=36, hit_tokens=0, hit_rate=0.0, output_tokens=3, evicted_blocks=6,
        rejected=0, truncated=0, preemptions=0, offload_hit_tokens=12, total_hit_rate=12 / 36,
        host_chunks=8, stored_blocks=6, loaded_blocks=3, offload_evictions=0,
    )
    recs = [json.loads(line) for line in (tmp_path / "recs.jsonl").read_text().splitlines()]
    assert [(r["id"], r["hit_tokens"], r["offload_hit_tokens"]) for r in recs] == [("A", 0, 0), ("B", 0, 0), ("A2", 0, 12)]


def test_cache_replay_sizes_the_tier_as_kvsim_run_does(aba: str) -> None:
    # two blocks a chunk: 4 chunks (the 12-token prompts are one chunk and a half)
    got = replay_json(aba, "-n", "4", *ABA, "--offload-blocks-per-chunk", "2")
    assert (got["host_chunks"], got["stored_blocks"], got["offload_hit_tokens"]) == (4, 4, 8)
    # TP 2: each rank holds half a block's KV, the size covers both: the same 8 chunks
    assert replay_json(aba, "-n", "4", *ABA, "--tp", "2")["host_chunks"] == 8
    # a 70B block is 320 KiB a token: 1/256 GiB holds 3 chunks, one prompt's: each prompt's
    # store evicts the one before (B evicts A's, A2 misses and evicts B's)
    big = replay_json(aba, "-n", "4", *ABA, "--model", "llama-3-70b")
    assert (big["host_chunks"], big["offload_evictions"], big["offload_hit_tokens"]) == (3, 6, 0)


def test_cache_replay_without_the_tier_prints_no_tier_fields(aba: str) -> None:
    assert "offload_hit_tokens" not in replay_json(aba, "-n", "4", "-b", "4")
    r = runner.invoke(app, ["cache-replay", aba, "-n", "4", *ABA, "--offload-all"])
    assert r.exit_code == 0, r.output
    assert "host tier      8 chunks of 1 blocks: 12 hit tokens, total hit rate 33.33%" in r.output


def test_curve_replay_and_sim_gain_the_tier_columns(aba: str, tmp_path: Path) -> None:
    rows = {}
    for mode in ("replay", "sim"):
        out = tmp_path / mode
        r = runner.invoke(app, ["curve", aba, "-c", "4,64", "-m", mode, "-w", "1", *ABA, "-o", str(out)])
        assert r.exit_code == 0, r.output
        assert "GPU + host tier hit rate (% of prompt tokens; 0.00390625 GiB host tier)" in r.output
        df = pd.read_parquet(out / "curve.parquet")
        rows[mode] = list(zip(df["capacity"], df["hit_rate"], df["offload_hit_tokens"], df["total_hit_rate"],
                              strict=True))
    # at 4 blocks A's return comes from the tier; at 64 its first two blocks hit on the GPU, and
    # the last one (which the GPU lookup leaves to be recomputed) in the tier
    assert rows["replay"] == [(4, 0.0, 12, 12 / 36), (64, 8 / 36, 4, 12 / 36)]
    assert rows["sim"] == rows["replay"]  # transfers long done before the next arrival


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kv-offloading-size", "0"], "kv_offloading_size must be a positive number of GiB, got 0.0"),
        (["--kv-offloading-size", "nan"], "kv_offloading_size must be a positive number of GiB, got nan"),
        (["--kv-offloading-size", "1", "--offload-eviction-policy", "mru"],
         "offload_eviction_policy must be one of lru, arc, got 'mru'"),
        (["--kv-offloading-size", "1", "--offload-blocks-per-chunk", "0"],
         "offload_blocks_per_chunk must be >= 1 and offload_store_threshold >= 0"),
        (["--kv-offloading-size", "1", "--offload-store-threshold", "-1"],
         "offload_blocks_per_chunk must be >= 1 and offload_store_threshold >= 0"),
        # a host tier's option with no host tier would change nothing, silently
        (["--offload-store-threshold", "2"], "--offload-store-threshold: a KV offloading option, and no host tier is "
                                             "given: give --kv-offloading-size GiB, or leave it out"),
        (["--offload-all"], "--offload-all: a KV offloading option, and no host tier is given: give "
                            "--kv-offloading-size GiB, or leave it out"),
        (["--kv-offloading-size", "1", "--model", "gpt-9"],
         "unknown model 'gpt-9'; choose from llama-3-8b, llama-3-70b, qwen2.5-7b, mistral-7b, deepseek-v3, "
         "gemma-3-12b, gemma-3-27b, gpt-oss-120b, gpt-oss-20b, llama-4-scout, mixtral-8x7b, qwen3-30b-a3b, qwen3-32b, "
         "qwen3-8b, qwen3-next-80b-a3b, or give the path of a config.json"),
        (["--kv-offloading-size", "1", "--tp", "3"], "tensor_parallel 3 must divide llama-3-8b's 32 attention heads"),
        (["--kv-offloading-size", "1", "--vllm-version", "0.28"],
         "kv_offloading_size cannot be combined with vllm_version 0.28: kvsim models offloading under vLLM 0.33's "
         "scheduler (sync or async), full attention and recompute preemption"),
    ],
)
@pytest.mark.parametrize("command", [["cache-replay", "ok.jsonl"], ["curve", "ok.jsonl", "-c", "10", "-o", "c"],
                                     ["run", "ok.jsonl", "--no-plots", "-o", "r"]])
def test_bad_knobs_are_one_line_errors_like_kvsim_run(command: list[str], args: list[str], message: str,
                                                      tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert_one_error([*command, *args], message)
