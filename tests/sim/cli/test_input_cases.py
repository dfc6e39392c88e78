"""Inputs that crashed or misled (issue 35, section 5), each as every command now takes it.

A request with an empty prompt is rejected, in every command, as vLLM 0.33 rejects it: its
InputProcessor._validate_prompt_len raises "The decoder prompt cannot be empty"
(vllm/v1/engine/input_processor.py) before the request reaches the scheduler. Azure rows with
ContextTokens 0, Mooncake input_length 0 and kvsim's "prompt": [] all make one. A gzipped trace
and one with a UTF-8 byte-order mark read as the plain file."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvsim.sim.cli.app import app
from tests.sim.engine.engine_fixtures import req, run

runner = CliRunner()


def _two(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text('{"id": "a", "arrival": 0, "prompt": [], "output_len": 2}\n'
                    '{"id": "b", "arrival": 1, "prompt": [1, 2, 3], "output_len": 2}\n')
    return path


def test_the_engine_rejects_it_and_serves_the_rest():
    res = run([req("a", 0, 0, 2), req("b", 1, 8, 2)])
    rq = res.requests.set_index("id")
    assert (rq.loc["a", "status"], rq.loc["a", "reason"]) == ("rejected", "empty_prompt")
    assert rq.loc["b", "status"] == "finished"
    assert (res.summary["rejected"], res.summary["dropped_empty_prompt"]) == (1, 1)


def test_run_says_so(tmp_path):
    r = runner.invoke(app, ["run", str(_two(tmp_path)), "--no-plots", "-o", str(tmp_path / "run")])
    assert r.exit_code == 0, r.output
    assert "Of 2 requests, 1 was rejected (empty prompt: 1); they count in no latency." in " ".join(r.output.split())


def test_cache_replay_rejects_it_too(tmp_path):
    r = runner.invoke(app, ["cache-replay", str(_two(tmp_path)), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert (out["requests"], out["rejected"], out["prompt_tokens"]) == (2, 1, 3)
    r = runner.invoke(app, ["cache-replay", str(_two(tmp_path)), "--json", "-k", "4"])
    assert json.loads(r.stdout)["rejected"] == 1


def test_workload_stats_names_them(tmp_path):
    path = _two(tmp_path)
    r = runner.invoke(app, ["workload", "stats", str(path)])
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[-1] == ("empty prompts  1: vLLM rejects a request with no prompt token, and so "
                                         "do kvsim run and cache-replay")
    r = runner.invoke(app, ["workload", "stats", str(path), "--json"])
    assert json.loads(r.stdout)["empty_prompts"] == 1


def test_gzip_and_a_byte_order_mark_read_as_the_plain_file(tmp_path):
    import gzip

    from kvsim.workloads.traces import detect_format, load_workload

    rows = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109\n"
    plain = tmp_path / "t.csv"
    plain.write_text(rows)
    (tmp_path / "bom.csv").write_bytes(b"\xef\xbb\xbf" + rows.encode())
    with gzip.open(tmp_path / "t.csv.gz", "wt") as f:
        f.write(rows)
    want = [(r.id, r.arrival, r.prompt_len) for r in load_workload(plain)]
    for name in ("bom.csv", "t.csv.gz"):
        assert detect_format(tmp_path / name) == "azure"
        assert [(r.id, r.arrival, r.prompt_len) for r in load_workload(tmp_path / name)] == want
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + _two(tmp_path).read_bytes())
    assert detect_format(tmp_path / "bom.jsonl") == "kvsim"
    assert [r.id for r in load_workload(tmp_path / "bom.jsonl")] == ["a", "b"]


def test_a_gzip_file_that_breaks_off_names_the_line(tmp_path):
    import gzip

    import pytest

    from kvsim.workloads.errors import WorkloadError
    from kvsim.workloads.traces import load_workload

    whole = gzip.compress(("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "2023-11-16 18:15:46.68,374,44\n" * 200).encode())
    path = tmp_path / "cut.csv.gz"
    path.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(WorkloadError, match=r"cut.csv.gz:\d+: cannot decompress"):
        list(load_workload(path))


def test_a_duplicate_request_id_is_one_error_in_every_command(tmp_path):
    import pytest

    import kvsim

    path = tmp_path / "dup.jsonl"
    path.write_text('{"id": "a", "arrival": 0, "prompt": [1, 2], "output_len": 2}\n'
                    '{"id": "a", "arrival": 1, "prompt": [1, 2, 3], "output_len": 2}\n')
    msg = f"error: {path}:2: field 'id': duplicate request id 'a' (first on line 1)\n"
    for argv in (["run", str(path), "--no-plots", "-o", str(tmp_path / "run")], ["workload", "stats", str(path)],
                 ["cache-replay", str(path)], ["conform", str(path), "--mode", "manager"]):
        r = runner.invoke(app, argv)
        assert (r.exit_code, r.stderr) == (2, msg), argv
    assert not (tmp_path / "run").exists()
    r = runner.invoke(app, ["workload", "stats", str(path), "--skip-bad", "--json"])
    assert json.loads(r.stdout)["requests"] == 1  # skipped and counted, as any bad line
    with pytest.raises(kvsim.WorkloadError, match=r"^requests\[1\]: field 'id': duplicate request id 'a'"):
        kvsim.simulate([req("a", 0, 4, 2), req("a", 1, 4, 2)])


def test_a_header_alone_or_an_empty_file_has_no_requests_everywhere(tmp_path):
    header = tmp_path / "hdr.csv"
    header.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    for path, fmt in ((header, "auto"), (empty, "kvsim")):
        for argv in (["run", str(path), "-f", fmt, "--no-plots", "-o", str(tmp_path / "run")],
                     ["workload", "stats", str(path), "-f", fmt], ["cache-replay", str(path), "-f", fmt]):
            r = runner.invoke(app, argv)
            assert (r.exit_code, r.stderr) == (2, f"error: {path}: no requests\n"), argv
    assert not (tmp_path / "run").exists()


def test_report_refuses_a_summary_that_is_not_kvsims(tmp_path):
    import shutil

    r = runner.invoke(app, ["run", "--no-plots", "-o", str(tmp_path / "run"), "--num-gpu-blocks", "300"])
    assert r.exit_code == 0, r.output
    foreign = tmp_path / "foreign"
    shutil.copytree(tmp_path / "run", foreign)
    (foreign / "summary.json").write_text('{"accuracy": 0.9}\n')
    r = runner.invoke(app, ["report", str(foreign)])
    assert (r.exit_code, r.stderr) == (2, f"error: {foreign / 'summary.json'}: not a kvsim summary (no 'requests')\n")


def test_a_pool_that_cannot_fit_in_memory_is_refused_before_it_is_made(monkeypatch):
    from kvsim.kvcache import block_pool

    monkeypatch.setattr(block_pool, "available_memory", lambda: 6 * 10**9)  # a 6 GB machine
    msg = ("num_gpu_blocks 1,000,000,000: the simulated pool needs about 128.0 GB of this machine's memory "
           "(128 bytes a block) and 6.0 GB is available")
    for argv in (["run", "--num-gpu-blocks", "1000000000"], ["cache-replay", "-n", "1000000000"]):
        r = runner.invoke(app, argv)
        assert (r.exit_code, r.stderr) == (2, f"error: {msg}\n"), argv
    r = runner.invoke(app, ["cache-replay", "-n", "2000", "--json"])  # what fits still runs
    assert r.exit_code == 0


def test_help_names_the_choices_and_defaults_and_there_is_a_version():
    from importlib.metadata import version

    from kvsim.sim.cli.options import DEFAULT_GPU, DEFAULT_MODEL
    from kvsim.sim.engine.config import SimConfig

    assert (DEFAULT_MODEL, DEFAULT_GPU) == (SimConfig().model, SimConfig().gpu)
    text = " ".join(runner.invoke(app, ["run", "--help"]).output.split())
    for shown in ("model: llama-3-8b, llama-3-70b, qwen2.5-7b, mistral-7b, deepseek-v3, gemma-3-12b, gemma-3-27b, "
                  "gpt-oss-120b, gpt-oss-20b, llama-4-scout, mixtral-8x7b, qwen3-30b-a3b, qwen3-32b, qwen3-8b, "
                  "qwen3-next-80b-a3b, or a Hugging Face config.json [default: llama-3-8b]",
                  "GPU: a100-80g|h100-sxm|h200|l40s|b200|mi300x, or a GPU file (.toml) [default: h100-sxm]", "[default: 16]",
                  "lru|lfu|fifo|s3fifo|cost|pinned|arc [default: lru]"):
        assert shown in text, shown
    r = runner.invoke(app, ["--version"])
    assert (r.exit_code, r.stdout) == (0, f"kvsim {version('kvsim')}\n")


def test_the_regress_workflow_tests_this_checkout_in_kvsims_own_repository(tmp_path):
    """Its install step, run as a shell would in this repository and in a user's."""
    import re
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    text = (root / ".github" / "workflows" / "kvsim-regress.yml").read_text()
    step = re.search(r"run: \|\n\s+(if grep .*; fi)\n", text).group(1)
    dry = step.replace("pip install .", "echo checkout").replace("pip install kvsim", "echo released")
    assert subprocess.run(["bash", "-c", dry], cwd=root, capture_output=True, text=True).stdout == "checkout\n"
    assert subprocess.run(["bash", "-c", dry], cwd=tmp_path, capture_output=True, text=True).stdout == "released\n"
