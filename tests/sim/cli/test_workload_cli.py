"""`kvsim workload generate` and `kvsim workload stats` through typer's CliRunner."""

import json

import pytest
from typer.testing import CliRunner

from kvsim.sim.cli.app import app
from kvsim.workloads.traces import load_workload

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, ["workload", *map(str, args)])


def test_stats_default_workload_text():
    r = invoke("stats")
    assert r.exit_code == 0, r.output
    assert "format         default" in r.output
    assert "requests       300 in 40 sessions" in r.output
    assert "blocks       83.72% (8,369 / 9,996 full blocks)" in r.output


def test_stats_json_keys():
    r = invoke("stats", "--json", "--block-size", "32")
    d = json.loads(r.stdout)
    assert d["requests"] == 300 and d["block_size"] == 32 and d["prompt_tokens"] == 162122
    for key in (
        "ideal_block_hit_rate",
        "ideal_token_hit_rate",
        "time_span",
        "mean_rate",
        "prompt_len",
    ):
        assert key in d


def test_stats_bad_file_is_a_clear_error_exit_2(write):
    path = write(
        "bad.jsonl", '{"timestamp": 0, "input_length": -3, "output_length": 1, "hash_ids": []}\n'
    )
    r = invoke("stats", path)
    assert r.exit_code == 2
    assert r.exception is None or isinstance(r.exception, SystemExit)
    assert (
        r.stderr
        == f"error: {path}:1: field 'input_length': expected a non-negative integer, got -3\n"
    )
    assert "Traceback" not in r.output


def test_stats_skip_bad_reports_count(write):
    good = '{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [7]}'
    path = write("m.jsonl", f"{good}\nnot json\n{good}\n")
    r = invoke("stats", path, "--skip-bad", "--json")
    assert r.exit_code == 0
    assert json.loads(r.stdout)["requests"] == 2 and json.loads(r.stdout)["skipped"] == 1
    assert r.stderr.startswith("skipped 1 bad lines (first: ")


def test_stats_format_option(write):
    path = write(
        "m.txt", '{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [7]}\n'
    )
    r = invoke("stats", path, "--format", "mooncake", "--json")
    assert json.loads(r.stdout)["prompt_tokens"] == 3
    assert invoke("stats", path, "--format", "kvsim").exit_code == 2


@pytest.mark.parametrize(
    "kind", ["shared-prefix", "multi-turn", "few-shot", "agent", "parallel", "unique", "default"]
)
def test_generate_each_kind_round_trips(tmp_path, kind):
    out = tmp_path / f"{kind}.jsonl"
    # the embedded workload is its own 300 requests (an -n for it is refused: tests/sim/cli/test_bad_input_cli.py)
    r = invoke("generate", kind, *([] if kind == "default" else ["-n", 30]), "--out", out, "--seed", 3)
    assert r.exit_code == 0, r.output
    n = 300 if kind == "default" else 30
    assert r.stdout == f"wrote {n} requests to {out}\n"
    reqs = list(load_workload(out))
    assert len(reqs) == n


def test_generate_is_deterministic_and_options_apply(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    args = [
        "-n",
        40,
        "--rate",
        5,
        "--arrival",
        "gamma",
        "--cv",
        2,
        "--samples",
        2,
        "--user-len",
        "uniform:10,20",
        "--output-len",
        "fixed:7",
    ]
    invoke("generate", "parallel", "--out", a, *args)
    invoke("generate", "parallel", "--out", b, *args)
    assert a.read_bytes() == b.read_bytes()
    reqs = list(load_workload(a))
    assert {r.n for r in reqs} == {2} and {r.output_len for r in reqs} == {7}
    assert all(10 <= r.prompt_len <= 20 for r in reqs)


def test_generate_multi_turn_writes_outputs_and_think_times(tmp_path):
    out = tmp_path / "mt.jsonl"
    invoke(
        "generate", "multi-turn", "-n", 20, "--out", out, "--turns", "fixed:3", "--think-time", 2
    )
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(len(r["output"]) == r["output_len"] and r["session"] for r in recs)
    assert sum("think_time" in r for r in recs) == sum(r["id"][-2:] != "-0" for r in recs)


def test_generate_rejects_bad_options(tmp_path):
    out = tmp_path / "x.jsonl"
    r = invoke("generate", "parallel", "--out", out, "--turns", "fixed:3")
    assert (r.exit_code, r.stderr) == (2, "error: kind 'parallel' does not take --turns\n")
    r = invoke("generate", "chat", "--out", out)
    assert r.exit_code == 2 and "unknown kind 'chat'" in r.stderr
    r = invoke("generate", "unique", "--out", out, "--user-len", "gauss:1")
    assert r.exit_code == 2 and "bad length spec 'gauss:1'" in r.stderr


def test_stats_on_real_mooncake_trace(traces):
    r = invoke("stats", traces / "mooncake/conversation_trace.jsonl", "--block-size", 512, "--json")
    d = json.loads(r.stdout)
    assert (d["requests"], d["prompt_tokens"], d["hit_blocks"], d["full_blocks"]) == (
        12031,
        144793823,
        105592,
        276491,
    )


def test_stats_with_a_model_gives_the_ideal_in_its_kv_cache_layout():
    """`--model`: a sequential replay through the model's own groups over a pool nothing is evicted
    from (sim/studies/layout_ideal.py). On the embedded workload the key scan's ideal is 82.59%;
    vLLM's lookup stops one token short of a prompt (82.55% in one group, and in gemma-3-27b's groups
    with dense retention); gemma's default sparse retention keeps its windows' tails only where a
    later request was seen to resume (74.18%); Qwen3-Next's 320-token blocks and Mamba states 43.03%."""
    def ideal(*args):
        r = invoke("stats", "--json", *args)
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)["layout_ideal"]

    assert ideal("--model", "llama-3-8b")["hit_tokens"] == 133_824
    gemma = ideal("--model", "gemma-3-27b")
    assert (gemma["groups"], gemma["hit_tokens"]) == (7, 120_256)
    assert ideal("--model", "gemma-3-27b", "--prefix-cache-retention-interval", "none")["hit_tokens"] == 133_824
    nxt = ideal("--model", "qwen3-next-80b-a3b", "--tp", "4")
    assert (nxt["block_size"], nxt["hit_tokens"]) == (320, 69_760)
    text = invoke("stats", "--model", "gemma-3-27b").stdout
    assert "ideal in gemma-3-27b's 7 KV-cache groups (a sequential replay, nothing evicted, block size 16):" in text
    assert "  tokens       74.18% (120,256 / 162,122 prompt tokens)" in text


def test_the_layout_ideal_reports_its_progress_every_thousand_requests():
    from kvsim.sim.api import generate_workload
    from kvsim.sim.engine.config import SimConfig
    from kvsim.sim.studies.layout_ideal import layout_ideal
    from kvsim.workloads.stats import describe

    wl = generate_workload("unique", num_requests=2_500, rate=50.0, seed=1)
    seen: list[int] = []
    layout_ideal(wl, SimConfig().validate(), describe(wl, 16), seen.append)
    assert seen == [1_000, 2_000]


def test_the_ideal_replays_pool_is_what_each_group_may_hash():
    """`pool_blocks` by hand: 10 requests, 100 full prompt blocks (40 of them ideal hits), 160
    output tokens, the longest request 320 tokens, blocks of 16 (21 blocks for it, one partial).
    A window of 64 under sparse retention hashes at most ceil(63 / 16) = 4 blocks at each of a
    request's 2 boundaries: 80 + 21. A full group alone hashes what the ideal misses,
    100 - 40 + 10 partial + 10 output + 10 + 21; beside other groups every prompt block (its hit
    may be cut to theirs): 100 + 10 + 10 + 10 + 21. One null block."""
    from types import SimpleNamespace

    from kvsim.kvcache.groups import GroupSpec
    from kvsim.sim.studies.layout_ideal import pool_blocks

    stats = SimpleNamespace(block_size=16, requests=10, full_blocks=100, hit_blocks=40, output_tokens=160)
    window, full = GroupSpec("sliding_window", 16, 64), GroupSpec("full", 16)
    assert pool_blocks(stats, [full], 320, None) == 1 + 111
    assert pool_blocks(stats, [window, full], 320, 0) == 1 + 101 + 151
    assert pool_blocks(stats, [window, full], 320, None) == 1 + 2 * 151
    assert pool_blocks(stats, [window, window, full], 320, 0) == 1 + 2 * 101 + 151


def test_the_ideal_replay_evicts_nothing_where_a_window_cuts_the_full_groups_hit():
    """gpt-oss-20b on a multi-turn workload: a turn's hit is cut to what its 128-token window kept,
    so the full group recomputes blocks it holds and hashes them again. A pool that counted only
    the ideal's distinct blocks for that group evicted 159 blocks here (the replay refuses that);
    counting every prompt block, nothing is evicted."""
    from kvsim.sim.api import generate_workload
    from kvsim.sim.engine.config import SimConfig
    from kvsim.sim.studies.layout_ideal import layout_ideal
    from kvsim.workloads.stats import describe

    wl = generate_workload("multi-turn", num_requests=300, seed=3)
    got = layout_ideal(wl, SimConfig(model="gpt-oss-20b").validate(), describe(wl, 16))
    assert (got["groups"], got["hit_tokens"], got["pool_blocks"]) == (2, 176_544, 26_208)
