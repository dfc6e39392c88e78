"""`kvsim run`, `kvsim report` and `kvsim compare` through typer's CliRunner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvsim.sim.cli.app import app
from kvsim.sim.cli.run import run_name
from kvsim.sim.engine.config import SimConfig
from kvsim.workloads.jsonl import write_jsonl
from tests.sim.engine.engine_fixtures import req

runner = CliRunner()


@pytest.fixture(scope="module")
def default_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("runs") / "default"
    r = runner.invoke(app, ["run", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("default (300 requests): llama-3-8b on h100-sxm x1, KV cache 512 blocks")
    assert f"\nrun folder: {out}\nplots:      {out / 'blocks.png'}\n" in r.stdout
    return out


def test_run_without_a_workload_simulates_the_default(default_run: Path) -> None:
    s = json.loads((default_run / "summary.json").read_text())
    assert (s["workload"], s["requests"], s["finished"]) == ("default", 300, 300)
    assert 0.5 < s["hit_rate"] < 1.0  # shared system prompts and chat turns hit
    assert (default_run / "blocks.png").is_file() and not (default_run / "ops.parquet").exists()


def test_run_a_workload_file_with_options(tmp_path: Path) -> None:
    wl = tmp_path / "two.jsonl"
    write_jsonl([req("a", 0, 40, 5), req("b", 0.1, 40, 5)], wl)
    out = tmp_path / "r"
    args = ["run", str(wl), "--num-gpu-blocks", "64", "--block-size", "8", "--eviction", "fifo",
            "--record-ops", "--no-plots", "--max-num-seqs", "1", "--max-model-len", "44", "--out", str(out)]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["num_gpu_blocks"], cfg["block_size"], cfg["eviction"], cfg["max_num_seqs"]) == (64, 8, "fifo", 1)
    assert (out / "ops.parquet").is_file() and not (out / "blocks.png").exists()
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["finished"], summary["output_tokens"]) == (2, 8)  # 40 + 5 capped at 44


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--block-size", "0"], "error: block_size must be a positive power of two, got 0\n"),
        (["--block-size", "12"], "error: block_size must be a positive power of two, got 12\n"),
        (["--model", "gpt-9"], "error: unknown model 'gpt-9'; choose from "),
        (["--gpu", "tpu-v5"], "error: unknown gpu 'tpu-v5'; choose from "),
        (["--eviction", "mru"], "error: unknown eviction policy 'mru'; choose from lru, "),
        (["--preemption", "drop"], "error: preemption must be 'recompute' or 'swap', got 'drop'\n"),
        (["--max-model-len", "1"], "error: max_model_len must be >= 2, got 1\n"),
        (["--num-gpu-blocks", "4"],
         "error: the KV cache (4 blocks of 16 tokens) is too small for any request of default "
         "(smallest dropped prompt: 139 tokens)\n"),
        (["--model", "llama-3-70b", "--gpu", "a100-80g"], "error: llama-3-70b does not fit on a100-80g"),
        (["missing.jsonl"], "error: missing.jsonl: no such file or directory\n"),
    ],
)
def test_bad_configs_exit_2_with_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    r = runner.invoke(app, ["run", *args, "--no-plots", "--out", str(tmp_path / "r")])
    assert r.exit_code == 2 and r.stderr.startswith(message), r.output
    assert r.stderr.count("\n") == 1 and not (tmp_path / "r").exists()


def test_a_bad_trace_line_is_an_error_or_skipped(tmp_path: Path) -> None:
    wl = tmp_path / "bad.jsonl"
    write_jsonl([req("a", 0, 40, 5)], wl)
    with open(wl, "a") as f:
        f.write('{"id": "b", "arrival": 1, "prompt": [1, 2], "output_len": -3}\n')
    r = runner.invoke(app, ["run", str(wl), "--no-plots", "--out", str(tmp_path / "r")])
    assert r.exit_code == 2 and r.stderr.startswith(f"error: {wl}:2: "), r.output
    r = runner.invoke(app, ["run", str(wl), "--skip-bad", "--no-plots", "--out", str(tmp_path / "r")])
    assert r.exit_code == 0 and r.stderr.startswith("skipped 1 bad lines"), r.output


def test_report_and_compare(default_run: Path, tmp_path: Path) -> None:
    r = runner.invoke(app, ["report", str(default_run), "--no-plots"])
    assert r.exit_code == 0 and "hit rate, tokens" in r.stdout
    plot = tmp_path / "cmp.png"
    r = runner.invoke(app, ["compare", str(default_run), str(default_run), "--plot", str(plot)])
    assert r.exit_code == 0, r.output
    header = r.stdout.splitlines()[0].split()
    assert header == ["default", "default"] and plot.read_bytes()[:4] == b"\x89PNG"
    r = runner.invoke(app, ["report", str(tmp_path)])
    assert r.exit_code == 2 and "not a run folder" in r.stderr


def test_default_run_names_are_deterministic() -> None:
    cfg = SimConfig()
    assert run_name("traces/conv.jsonl", cfg) == run_name("traces/conv.jsonl", SimConfig())
    assert run_name("traces/conv.jsonl", cfg).startswith("conv-llama-3-8b-h100-sxm-tp1-bs16-")
    assert run_name("traces/conv.jsonl", cfg) != run_name("traces/conv.jsonl", cfg.replace(watermark=0.1))


def test_kv_events_are_written_a_json_line_a_step(tmp_path: Path) -> None:
    from kvsim.kvcache.hashing import block_keys

    wl = tmp_path / "two.jsonl"
    write_jsonl([req("a", 0, list(range(40)), 2), req("b", 5, list(range(40)), 2)], wl)
    events = tmp_path / "events.jsonl"
    args = ["run", str(wl), "--num-gpu-blocks", "64", "--block-size", "16", "--step-time", "1", "--no-plots",
            "--out", str(tmp_path / "r"), "--kv-events", str(events)]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    keys = block_keys(list(range(40)), 16)
    # a's prompt cached at step 0; b hits both blocks at step 5 and caches nothing new
    assert lines == [{"ts": 1.0, "replica": 0, "step": 0, "events": [
        {"type": "BlockStored", "block_hashes": keys, "parent_block_hash": None, "token_ids": list(range(32)),
         "block_size": 16, "medium": "GPU", "group_idx": 0}]}]
    assert json.loads((tmp_path / "r" / "config.json").read_text())["kv_events"] is True


def test_kv_events_with_offloading_carry_the_cpu_tiers_after_the_gpus(tmp_path: Path) -> None:
    from kvsim.kvcache.hashing import block_keys

    wl = tmp_path / "two.jsonl"
    write_jsonl([req("a", 0, list(range(40)), 2), req("b", 5, list(range(40)), 2)], wl)
    events = tmp_path / "events.jsonl"
    args = ["run", str(wl), "--num-gpu-blocks", "64", "--block-size", "16", "--step-time", "1", "--no-plots",
            "--out", str(tmp_path / "r"), "--kv-events", str(events), "--kv-offloading-size", "0.03125"]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    keys = block_keys(list(range(40)), 16)
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    # a's 2 prompt chunks are offered at step 0, copied from step 1's start and applied in the empty
    # step 2 (vLLM's CPU manager's complete_store): a placeholder BlockStored a chunk, medium CPU
    assert [(line["step"], line["ts"]) for line in lines] == [(0, 1.0), (2, 2.0)]
    assert lines[1]["events"] == [{"type": "BlockStored", "block_hashes": [k], "parent_block_hash": None, "token_ids": [],
                                   "block_size": 0, "medium": "CPU", "group_idx": 0} for k in keys]
    r = runner.invoke(app, [*args, "--offload-fs", "--out", str(tmp_path / "r2")])
    assert r.exit_code == 2 and r.stderr == ("error: kv_events: the host tier's KV events with a file tier below it "
                                             "(offload_fs) are not modelled; run without one of the two\n")


def test_kv_events_to_an_unwritable_path_or_a_failed_run_leave_no_file(tmp_path: Path) -> None:
    r = runner.invoke(app, ["run", "--no-plots", "--out", str(tmp_path / "r"), "--kv-events", str(tmp_path / "no" / "e")])
    assert r.exit_code == 2 and r.stderr == f"error: {tmp_path / 'no' / 'e'}: cannot write there ({tmp_path / 'no'} does not exist)\n"
    events = tmp_path / "events.jsonl"
    r = runner.invoke(app, ["run", "--num-gpu-blocks", "4", "--no-plots", "--out", str(tmp_path / "r"),
                            "--kv-events", str(events)])
    assert r.exit_code == 2 and "too small" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_an_engine_that_stalls_is_one_line_and_leaves_no_run_folder(tmp_path, monkeypatch):
    # a preemption cycle (tests/sim/engine/test_async_scheduling.py) or an empty schedule with nothing
    # left to arrive: `kvsim run` says so on one line, exit 2, and writes nothing
    from kvsim.sim.engine import loop
    from kvsim.sim.engine import run as engine_run

    said = "scheduler made no progress: 50,000 preemptions in a row with no token decoded and no request finished"

    def stalls(*args, **kwargs):
        raise loop.Stalled(said)

    monkeypatch.setattr(engine_run, "simulate", stalls)
    out = tmp_path / "r"
    r = runner.invoke(app, ["run", "--no-plots", "-o", str(out)])
    assert (r.exit_code, r.stderr, out.exists()) == (2, f"error: {said}\n", False)


def test_the_run_options_name_every_router_field() -> None:
    """`kvsim run`'s router options (restated in sim/cli/run.py, which `--help` loads without numpy)
    are config.py's ROUTER_FIELDS."""
    from kvsim.sim.cli.run import ROUTER_OPTIONS
    from kvsim.sim.engine.config import ROUTER_FIELDS

    assert ("router", "router_metrics_interval", *ROUTER_OPTIONS) == ROUTER_FIELDS
