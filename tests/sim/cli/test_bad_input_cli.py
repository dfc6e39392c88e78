"""Bad traces and bad numbers, command by command: one `error:` line naming the file, line and
field (or the option), a non-zero exit, no traceback, nothing written (see bad_input.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.sim.cli.bad_input import assert_one_error, write_files

NOT_TEXT = "png.jsonl:1: not UTF-8 text (byte 0x89 at column 1); is this a trace file?"
NO_VLLM = pytest.mark.needs_vllm  # tests/conftest.py: skipped without vLLM, failed in CI
POW2 = "block_size must be a positive power of two, got 3"


@pytest.fixture(autouse=True)
def in_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_files(tmp_path)
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize(
    ("args", "message", "code"),
    [
        # a binary file as a trace, every command that reads one
        (["run", "png.jsonl", "--no-plots", "-o", "r"], NOT_TEXT, 2),
        (["cache-replay", "png.jsonl"], NOT_TEXT, 2),
        pytest.param(["conform", "png.jsonl"], NOT_TEXT, 2, marks=NO_VLLM),
        (["workload", "stats", "png.jsonl"], NOT_TEXT, 2),
        (["curve", "png.jsonl", "-c", "10,20", "-o", "c"], NOT_TEXT, 2),
        # each format's own reader
        (["workload", "stats", "bin.csv"],
         "bin.csv:2: not UTF-8 text (byte 0xff at column 1); is this a trace file?", 2),
        (["run", "rp_bin", "--no-plots", "-o", "r"],
         "rp_bin/0_trace.jsonl:1: not UTF-8 text (byte 0x89 at column 1); is this a trace file?", 2),
        (["workload", "stats", "rp"], "rp/1_sys_prompt.jsonl: missing RAGPulse chunk-length file", 2),
        (["run", "adir", "--no-plots", "-o", "r"],
         "adir: a folder but not a RAGPulse trace (no 0_trace.jsonl in it)", 2),
        (["cache-replay", "empty.jsonl"], "empty.jsonl: empty, no records", 2),
        (["run", "inf.jsonl", "--no-plots", "-o", "r"],
         "inf.jsonl:1: field 'timestamp': expected a non-negative number, got Infinity", 2),
        (["cache-replay", "nan.csv"],
         "nan.csv:2: field 'ContextTokens': expected a non-negative integer, got \"NaN\"", 2),
        (["curve", "kvnan.jsonl", "-c", "10", "-o", "c"],
         "kvnan.jsonl:1: field 'arrival': expected a non-negative number, got NaN", 2),
        (["workload", "stats", "nope.jsonl"], "nope.jsonl: no such file or directory", 2),
        (["cache-replay", "ok.jsonl", "-f", "parquet"],
         "unknown format 'parquet'; expected one of auto, mooncake, azure, ragpulse, kvsim", 2),
    ],
)
def test_bad_trace(args: list[str], message: str, code: int) -> None:
    assert_one_error(args, message, code)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_unreadable_trace() -> None:
    os.chmod("ok.jsonl", 0)
    assert_one_error(["run", "ok.jsonl", "--no-plots", "-o", "r"],
                     "ok.jsonl: cannot read (Permission denied)")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--load", "inf"], "load must be a positive finite number, got inf"),
        (["--load", "0"], "load must be a positive finite number, got 0.0"),
        (["--slo-ttft", "-1"], "slo_ttft must be a positive number of seconds, got -1.0"),
        (["--slo-tpot", "nan"], "slo_tpot must be a positive number of seconds, got nan"),
        (["--watermark", "nan"], "watermark must be in [0, 1), got nan"),
        (["--step-time", "inf"], "step_time must be a positive number of seconds, got inf"),
        (["--gpu-memory-utilization", "nan"], "gpu_memory_utilization must be in (0, 1], got nan"),
        (["--num-gpu-blocks", "1"], "num_gpu_blocks must be at least 2 (block 0 is reserved), got 1"),
        (["--num-cpu-blocks", "-1"], "num_cpu_blocks must be >= 0, got -1"),
        (["--block-size", "3"], POW2),
        (["--tp", "0"], "tensor_parallel must be >= 1, got 0"),
        (["--kv-offloading-size", "1", "--offload-fs-size", "10"],
         "--offload-fs-size: the file tier's option, and no file tier is given: give --offload-fs, or leave it out"),
        (["--kv-lease-duration", "5"], "--kv-lease-duration: a KV transfer's option, and this run moves no KV between "
                                       "replicas: give --prefill-replicas P --decode-replicas D or --kv-transfer-role, "
                                       "or leave it out"),
        # a router's options without a cluster (`--replicas 1` is a cluster of one, and runs)
        (["--router", "llm-d"], "--router: a router's option, and this run has one replica: give --replicas N "
                                "(or --prefill-replicas P --decode-replicas D), or leave it out"),
        (["--kv-event-delay", "0.01"], "--kv-event-delay: a router's option, and this run has one replica: give "
                                       "--replicas N (or --prefill-replicas P --decode-replicas D), or leave it out"),
        (["--step-time", "0.01", "--calibration", "cal.json"],
         "--calibration: --step-time fixes every step's time, so the calibration of the cost model changes nothing: "
         "leave one of the two out"),
        (["--workers", "2"], "--workers 2: runs a cluster's replicas apart, and this run is one engine: give "
                             "--replicas N, or leave it out"),
        (["--prefill-replicas", "1", "--decode-replicas", "1", "--workers", "2"],
         "--workers 2: runs a cluster's replicas apart, and this run is a P/D cluster, whose pools interact: leave it out"),
    ],
)
def test_run_bad_number(args: list[str], message: str) -> None:
    assert_one_error(["run", "ok.jsonl", *args, "--no-plots", "-o", "r"], message)


@pytest.mark.parametrize("command", [["run", "ok.jsonl", "--no-plots", "-o", "r"],
                                     ["run", "ok.jsonl", "--replicas", "2", "--no-plots", "-o", "r"],
                                     ["capacity", "ok.jsonl", "--slo-ttft", "1", "--slo-tpot", "0.1", "--max-replicas", "2"]])
def test_a_deciders_option_without_pd_pools_is_refused(command: list[str]) -> None:
    what = "search" if command[0] == "capacity" else "run"
    assert_one_error([*command, "--pd-threshold", "32"],
                     f"--pd-threshold: a P/D cluster's option, and this {what} has no P/D pools: give "
                     "--prefill-replicas P --decode-replicas D, or leave it out")


@pytest.mark.parametrize(("args", "message"), [
    (["--mode", "scheduler", "-k", "4"], "--max-running is the manager mode's (K sequences at once), and --mode "
                                         "scheduler runs no manager mode: give --mode manager or both, or leave it out"),
    (["--mode", "manager", "--step-time", "0.05"], "--step-time is the scheduler mode's, and --mode manager runs the "
                                                   "block manager alone: give --mode scheduler or both, or leave it out"),
    (["--pd"], "--pd picks among --random's cases: give --random START:STOP (one side of P/D for a workload: "
               "--kv-transfer-role)"),
    (["--only-hybrid"], "--only-hybrid picks among --random's cases: give --random START:STOP"),
])
def test_conform_refuses_an_option_its_mode_would_not_use(args: list[str], message: str) -> None:
    """Checked before anything runs (no vLLM needed): each would change nothing, silently."""
    assert_one_error(["conform", "ok.jsonl", *args], message)


def test_conform_random_refuses_a_configuration() -> None:
    assert_one_error(["conform", "--random", "0:2", "--num-gpu-blocks", "100"],
                     "--random makes its own configurations: give no --num-gpu-blocks")


def test_a_rate_search_on_one_engine_refuses_a_router() -> None:
    assert_one_error(["capacity", "ok.jsonl", "--slo-ttft", "1", "--slo-tpot", "0.1", "--router", "llm-d"],
                     "--router: a router's option, and this search has one replica: give --replicas N or "
                     "--max-replicas N (or --prefill-replicas P --decode-replicas D), or leave it out")


@pytest.mark.parametrize(
    ("args", "message", "code"),
    [
        (["cache-replay", "ok.jsonl", "-b", "3"], POW2, 2),
        (["cache-replay", "ok.jsonl", "-k", "0"], "--max-running must be >= 1, got 0", 2),
        (["cache-replay", "ok.jsonl", "-n", "1"],
         "--num-blocks must be at least 2 (block 0 is reserved), got 1", 2),
        (["curve", "ok.jsonl", "-c", "10", "-b", "3", "-o", "c"], POW2, 2),
        (["curve", "ok.jsonl", "-c", "10", "--workers", "0", "-o", "c"],
         "--workers must be >= 1, got 0", 2),
        (["curve", "ok.jsonl", "-c", "10,x", "-o", "c"],
         "--capacities must be comma-separated integers, got '10,x'", 2),
        (["curve", "ok.jsonl", "-c", "-5", "-o", "c"],
         "capacity must be at least 2 blocks (block 0 is reserved), got -5", 2),
        pytest.param(["conform", "ok.jsonl", "--block-size", "3"], POW2, 2, marks=NO_VLLM),
        pytest.param(["conform", "ok.jsonl", "--watermark", "inf"],
                     "watermark must be in [0, 1), got inf", 2, marks=NO_VLLM),
        (["workload", "generate", "multi-turn", "-n", "10", "--rate", "nan", "-o", "x.jsonl"],
         "rate must be a finite number > 0, got nan", 2),
        (["workload", "generate", "multi-turn", "-n", "10", "--think-time", "inf", "-o", "x.jsonl"],
         "think_time must be a finite number >= 0, got inf", 2),
        (["workload", "generate", "shared-prefix", "--cv", "-1", "-o", "x.jsonl"],
         "cv must be a finite number >= 0, got -1.0", 2),
        (["workload", "generate", "unique", "-n", "0", "-o", "x.jsonl"],
         "--num-requests must be >= 1, got 0", 2),
        # the embedded workload's requests and arrivals are its own: a shape option is refused, not ignored
        (["workload", "generate", "default", "-n", "60", "-o", "x.jsonl"],
         "kind 'default' is the embedded workload (300 requests at their own times): it takes no --num-requests", 2),
        (["workload", "generate", "default", "--rate", "2", "-o", "x.jsonl"],
         "kind 'default' is the embedded workload (300 requests at their own times): it takes no --rate", 2),
        (["workload", "stats", "ok.jsonl", "-b", "0"], "--block-size must be >= 1, got 0", 2),
    ],
)
def test_bad_number(args: list[str], message: str, code: int) -> None:
    assert_one_error(args, message, code)


def test_a_late_bad_line_leaves_no_partial_output() -> None:
    """The records of the good lines were already out when the bad one came: none is kept."""
    bad = "late_bad.jsonl:3: field 'output_len': expected a non-negative integer, got -3"
    assert_one_error(["cache-replay", "late_bad.jsonl", "-o", "records.jsonl"], bad)
    assert_one_error(["run", "late_bad.jsonl", "--no-plots", "-o", "r"], bad)
    assert_one_error(["curve", "late_bad.jsonl", "-c", "10", "-o", "c"], bad)
