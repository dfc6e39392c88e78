"""`kvsim gpu-replay` and `kvsim calibrate` through typer's CliRunner."""

import json

import gpu_scenarios as scenarios
import pytest
from gpu_env import HAS_CUDA
from typer.testing import CliRunner

from kvsim.kvcache.ops import read_ops
from kvsim.sim.cli.app import app
from kvsim.sim.engine.cost_model import load_calibration

runner = CliRunner()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder, _ = scenarios.lifecycle(tmp_path_factory.mktemp("cli"))
    return folder


def test_gpu_replay_prints_the_report(run):
    r = runner.invoke(app, ["gpu-replay", str(run), "--device", "cpu", "--layers", "1", "--head-dim", "8"])
    assert r.exit_code == 0, r.output
    assert "on cpu with torch kernels (float32; 1 layers x 2 KV heads x 8 dims, 4 query heads, block size 4)" in r.output
    assert ("verified       265 tokens in 20 sequence checks, decode attention not checked "
            "(--attention-layers N checks it)") in r.output
    assert "mismatches     0" in r.output


def test_gpu_replay_with_triton_kernels_checks_decode_attention(run):
    r = runner.invoke(app, ["gpu-replay", str(run), "--device", "cpu", "--kernels", "triton", "--layers", "1",
                            "--head-dim", "8"])
    assert r.exit_code == 0, r.output
    assert "on cpu with triton kernels" in r.output
    assert "verified       265 tokens in 20 sequence checks, 17 decode-attention checks (1 layers)" in r.output


def test_gpu_replay_attention_sample(run):
    base = ["gpu-replay", str(run), "--device", "cpu", "--layers", "1", "--head-dim", "8"]
    r = runner.invoke(app, [*base, "--attention-layers", "1", "--attention-sample", "2"])
    assert r.exit_code == 0, r.output
    assert "20 sequence checks, 14 decode-attention checks (1 layers, at most 2 a step)" in r.output
    for extra, message in (
        (["--attention-sample", "2"], "compares none (the torch kernels' default): give --attention-layers N too"),
        (["--attention-layers", "0", "--attention-sample", "2"], "compares none (--attention-layers 0): give"),
        (["--attention-layers", "1", "--attention-sample", "0"], "--attention-sample must be >= 1, got 0"),
    ):
        r = runner.invoke(app, [*base, *extra])
        assert r.exit_code == 2 and message in r.output, r.output


def test_gpu_replay_json(run):
    r = runner.invoke(app, ["gpu-replay", str(run), "--device", "cpu", "--layers", "1", "--check-every", "2",
                            "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["mismatches"] == 0 and rep["steps_checked"] == 4 and rep["ops"]["move"] == 5
    assert (rep["steps"], rep["tokens_verified"], rep["kernels"], rep["first_mismatches"]) == (8, 132, "torch", [])


def test_gpu_replay_exits_1_on_a_mismatch(run, tmp_path):
    for name in ("op_tokens.parquet", "config.json"):
        (tmp_path / name).write_bytes((run / name).read_bytes())
    scenarios.write_ops(tmp_path, [op for op in read_ops(run / "ops.parquet") if op.kind != "copy"])
    r = runner.invoke(app, ["gpu-replay", str(tmp_path), "--device", "cpu", "--layers", "1"])
    assert r.exit_code == 1
    assert "mismatches     10" in r.stdout
    assert r.stderr.startswith("integrity error: step 1, sequence 'A': position 8 (block-table entry 2, "
                               "physical block 9), layer 0 K head 0")
    r = runner.invoke(app, ["gpu-replay", str(tmp_path), "--device", "cpu", "--layers", "1", "--json"])
    assert r.exit_code == 1
    first = json.loads(r.stdout)["first_mismatches"][0]
    assert {k: first[k] for k in ("step", "seq", "position", "block", "what", "blocks")} == {
        "step": 1, "seq": "A", "position": 8, "block": 9, "what": "K", "blocks": [9]}


def test_gpu_replay_missing_file_is_one_line_exit_2(tmp_path):
    (tmp_path / "config.json").write_text('{"block_size": 16}')
    r = runner.invoke(app, ["gpu-replay", str(tmp_path), "--device", "cpu"])
    assert r.exit_code == 2
    assert r.stderr == (f"error: {tmp_path / 'ops.parquet'}: missing; record the op stream with `kvsim run "
                        f"--record-ops` (or KVCacheManager(record_ops=True) and manager.ops.save(folder))\n")
    assert "Traceback" not in r.output


def test_gpu_replay_rejects_bad_options(run):
    r = runner.invoke(app, ["gpu-replay", str(run), "--device", "tpu"])
    assert r.exit_code == 2 and "--device must be cuda or cpu, got 'tpu'" in r.stderr
    r = runner.invoke(app, ["gpu-replay", str(run), "--device", "cpu", "--check-every", "0"])
    assert r.exit_code == 2 and "--check-every must be >= 1, got 0" in r.stderr
    r = runner.invoke(app, ["gpu-replay", str(run), "--device", "cpu", "--dtype", "int8"])
    assert r.exit_code == 2 and "unknown dtype 'int8'" in r.stderr
    r = runner.invoke(app, ["gpu-replay", str(run), "--kernels", "cuda"])
    assert r.exit_code == 2 and "--kernels must be triton or torch, got 'cuda'" in r.stderr
    fp8 = ["gpu-replay", str(run), "--device", "cpu", "--layers", "1", "--dtype", "fp8", "--kv-scale"]
    for scale, why in (("half", "--kv-scale 'half': a number, or two as K,V"),
                       ("1,2,4", "--kv-scale '1,2,4': a number, or two as K,V"),
                       ("3", "K scale 3: a power of two from 2^-8 to 2^6")):
        r = runner.invoke(app, [*fp8, scale])
        assert r.exit_code == 2 and r.stderr.count("\n") == 1 and why in r.stderr, r.stderr
    r = runner.invoke(app, ["gpu-replay", str(run), "--device", "cpu", "--kv-scale", "2"])
    assert r.exit_code == 2 and "kv scales 2, 2: only an FP8 cache is scaled" in r.stderr


def test_gpu_replay_fp8(run):
    r = runner.invoke(app, ["gpu-replay", str(run), "--device", "cpu", "--layers", "1", "--head-dim", "8",
                            "--dtype", "fp8", "--kv-scale", "0.5,2"])
    assert r.exit_code == 0, r.output
    assert "(float8_e4m3fn; 1 layers x 2 KV heads x 8 dims" in r.stdout and "mismatches     0" in r.stdout


@pytest.mark.skipif(HAS_CUDA, reason="checks the message shown without a GPU")
def test_cuda_without_a_gpu_is_a_clear_error(run):
    r = runner.invoke(app, ["gpu-replay", str(run), "--device", "cuda"])
    assert r.exit_code == 2 and "no CUDA device" in r.stderr


def test_calibrate_writes_a_profile_the_simulator_loads(tmp_path):
    out = tmp_path / "cal.json"
    r = runner.invoke(app, ["calibrate", "--device", "cpu", "--out", str(out)])
    assert r.exit_code == 0, r.output
    profile = json.loads(out.read_text())
    assert list(profile) == ["version", "device", "efficiency", "overhead_s", "op_cost_s"]
    assert profile["version"] == 1 and profile["device"] == "cpu-interpreter"
    assert list(profile["op_cost_s"]) == ["copy", "swap_out", "swap_in", "move"]
    cal = load_calibration(out)
    assert cal.device == "cpu-interpreter" and 0 < cal.memory <= 1 and 0 < cal.compute <= 1
    assert cal.overhead_s >= 1e-3 and all(v > 0 for _, v in cal.op_cost_s)
    assert "decode_attention" in r.output and f"wrote {out}" in r.output


def test_a_fresh_process_picks_the_interpreter_itself(run):
    """TRITON_INTERPRET must be set before triton's first import; the command does it for --device cpu."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", "from sim.cli.app import app; app()", "gpu-replay", str(run),
                          "--device", "cpu", "--layers", "1", "--head-dim", "8", "--check-every", "4"],
                         capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert "mismatches     0" in out.stdout


@pytest.fixture(scope="module")
def every_kind(tmp_path_factory):
    return scenarios.every_kind(tmp_path_factory.mktemp("every-kind"))


def test_injected_faults_are_all_reported(every_kind):
    r = runner.invoke(app, ["gpu-replay", str(every_kind), "--device", "cpu", "--layers", "1",
                            "--inject-faults", "6", "--seed", "3", "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert sorted(f["kind"] for f in rep["faults"]) == sorted(
        ["copy_dropped", "move_reversed", "move_dropped", "swap_in_wrong", "write_misplaced", "reused_while_referenced"])
    assert all(f["caught"] for f in rep["faults"]) and rep["mismatches"] > 0
    r = runner.invoke(app, ["gpu-replay", str(every_kind), "--device", "cpu", "--layers", "1",
                            "--inject-faults", "6", "--seed", "3"])
    assert r.exit_code == 0 and r.stdout.rstrip().endswith("caught 6 of 6 injected faults")


def test_a_missed_fault_exits_1_and_names_it(every_kind, monkeypatch):
    from kvsim.gpu import faults

    monkeypatch.setattr(faults, "attribute", lambda faults, rep: [False] + [True] * (len(faults) - 1))
    r = runner.invoke(app, ["gpu-replay", str(every_kind), "--device", "cpu", "--layers", "1",
                            "--inject-faults", "2", "--seed", "3"])
    assert r.exit_code == 1
    assert r.stderr.startswith("fault injection: 1 of 2 injected faults not reported, the first: ")


def test_fault_injection_rejects_what_it_cannot_judge(every_kind, run):
    base = ["gpu-replay", str(every_kind), "--device", "cpu"]
    r = runner.invoke(app, [*base, "--inject-faults", "-1"])
    assert r.exit_code == 2 and "--inject-faults must be >= 0, got -1" in r.stderr
    for extra in (["--check-every", "2"], ["--check", "touched"]):
        r = runner.invoke(app, [*base, "--inject-faults", "2", *extra])
        assert r.exit_code == 2 and "--inject-faults needs every step read whole" in r.stderr
    r = runner.invoke(app, ["gpu-replay", str(run), "--device", "cpu", "--inject-faults", "50", "--seed", "0"])
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith("error: cannot inject 50 faults: only ")


def test_touched_check_and_progress_lines(run, monkeypatch):
    from kvsim.gpu import replay

    monkeypatch.setattr(replay, "PROGRESS_S", 0.0)
    r = runner.invoke(app, ["gpu-replay", str(run), "--device", "cpu", "--layers", "1", "--check", "touched",
                            "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert (rep["check"], rep["mismatches"], rep["steps_checked"], rep["tokens_verified"]) == ("touched", 0, 8, 129)
    assert r.stderr.splitlines()[0].startswith("step 0 of 7: ")
    assert r.stderr.splitlines()[-1].startswith("step 7 of 7: 129 tokens verified, 0 mismatches, ")
    assert r.stderr.splitlines()[-1].endswith(" s, about 0 s left")  # the last step: nothing left
    r = runner.invoke(app, ["gpu-replay", str(run), "--device", "cpu", "--check", "some"])
    assert r.exit_code == 2 and "--check must be full or touched, got 'some'" in r.stderr
