"""benchmarks/bench_blis.py without BLIS: the Azure trace as BLIS's TraceV2 pair, the commands, the skip.

The TraceV2 columns are BLIS's `traceV2Columns` (inference-sim `sim/workload/tracev2.go`); a
zero `send_time_us` makes replay inject at `arrival_time_us` (`injectionTime`, `sim/workload/replay.go`)
and a zero `deadline_us` means no timeout (`TraceRecord.DeadlineUs`).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_blis  # noqa: E402

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:50.9951695,10,1
2023-11-16 18:16:00,2,7
"""


def _convert(tmp_path: Path, text: str) -> tuple[int, Path, Path]:
    src, header, data = tmp_path / "conv.csv", tmp_path / "t.yaml", tmp_path / "t.csv"
    src.write_text(text)
    return bench_blis.azure_to_tracev2(src, header, data), header, data


def test_azure_rows_become_tracev2_rows_with_microsecond_arrivals(tmp_path):
    n, header, data = _convert(tmp_path, AZURE)
    assert n == 4
    assert header.read_text() == "trace_version: 3\ntime_unit: microseconds\nmode: real\nwarm_up_requests: 0\n"
    lines = data.read_text().splitlines()
    assert lines[0] == bench_blis.TRACEV2_COLUMNS and len(lines[0].split(",")) == 27
    # 50.9951695 s - 46.68059 s = 4,314,579.5 us: half to even, 4,314,580
    assert lines[1:] == [
        "0,azure,,,,0,,0,false,374,44,0,0,0,0,0,,0,0,0,0,0,0,0,ok,,",
        "1,azure,,,,0,,0,false,396,109,0,0,0,0,0,,0,0,4314579,0,0,0,0,ok,,",
        "2,azure,,,,0,,0,false,10,1,0,0,0,0,0,,0,0,4314580,0,0,0,0,ok,,",
        "3,azure,,,,0,,0,false,2,7,0,0,0,0,0,,0,0,13319410,0,0,0,0,ok,,",
    ]


@pytest.mark.parametrize(("row", "message"), [
    ("2023-11-16 18:15:47.1,x,44", "conv.csv:3: field 'ContextTokens': expected a whole number, got 'x'"),
    ("2023-11-16 18:15:47.1,3,-1", "conv.csv:3: field 'GeneratedTokens': expected a whole number, got '-1'"),
    ("2023-11-16 18:15:40.0,3,4", "conv.csv:3: field 'TIMESTAMP': '2023-11-16 18:15:40.0' is before the row above"),
    ("16/11/2023 18:15,3,4", "conv.csv:3: field 'TIMESTAMP': expected 'YYYY-MM-DD HH:MM:SS.f', got '16/11/2023 18:15'"),
    ("2023-11-16 18:15:47.1,3", "conv.csv:3: expected 3 fields, got 2"),
])
def test_a_bad_row_is_named_by_file_line_and_field(tmp_path, row, message):
    with pytest.raises(ValueError) as err:
        _convert(tmp_path, "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n" + row + "\n")
    assert str(err.value) == f"{tmp_path}/{message}"


def _fake_blis(tmp_path: Path) -> Path:
    tree = tmp_path / "inference-sim"
    tree.mkdir()
    for name in ("defaults.yaml", "hardware_config.json", "blis"):
        (tree / name).write_text("")
    return tree / "blis"


def test_commands_carry_the_same_knobs_to_both_simulators(tmp_path):
    binary = _fake_blis(tmp_path)
    azure = tmp_path / "conv.csv"
    azure.write_text(AZURE)
    cluster = bench_blis.prepare(binary, azure, tmp_path / "work", 8)
    lone = bench_blis.prepare(binary, azure, tmp_path / "work", 1)
    blis = cluster["blis"]
    knobs = {blis[i]: blis[i + 1] for i in range(2, len(blis) - 1) if blis[i].startswith("--")}
    assert knobs == {
        "--trace-header": str(tmp_path / "work/azure.yaml"), "--trace-data": str(tmp_path / "work/azure.csv"),
        "--model": "meta-llama/meta-llama-3-70b", "--hardware": "A100-80", "--tp": "2",
        "--block-size-in-tokens": "16", "--total-kv-blocks": "1643", "--max-num-batched-tokens": "8192",
        "--max-num-seqs": "256", "--routing-policy": "round-robin", "--num-instances": "8",
        "--max-model-len": "26288", "--horizon": str(10**15),
        "--model-config-folder": str(tmp_path / "work/model_configs/llama-3-70b"),
        "--defaults-filepath": str(binary.parent / "defaults.yaml"),
        "--hardware-config": str(binary.parent / "hardware_config.json"),
    }
    assert blis[:2] == [str(binary), "replay"] and lone["blis"] == [*blis[:-11], "1", *blis[-10:]]
    assert cluster["kvsim"][1:] == ["-m", "kvsim", "run", str(azure), *bench_blis.AZURE_KNOBS, "--no-plots",
                                    "--no-async-scheduling", "--router", "round-robin", "--replicas", "8", "--out", str(tmp_path / "work/kvsim-8")]
    assert lone["kvsim"][1:] == ["-m", "kvsim", "run", str(azure), *bench_blis.AZURE_KNOBS, "--no-plots",
                                 "--no-async-scheduling", "--out", str(tmp_path / "work/kvsim-1")]
    roofline = bench_blis.prepare(binary, azure, tmp_path / "work", 8, "roofline")["blis"]
    assert roofline == [*blis, "--latency-model", "roofline"]
    config = json.loads((tmp_path / "work/model_configs/llama-3-70b/config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_key_value_heads"],
            config["intermediate_size"], config["vocab_size"]) == (80, 8192, 8, 28672, 128256)


def test_blis_finished_count_is_read_from_its_last_metrics_block():
    stdout = '{\n  "instance_id": "instance_0",\n  "completed_requests": 2421,\n}\n' \
             '{\n  "instance_id": "cluster",\n  "completed_requests": 19366,\n}\nDropped Unservable: 0\n'
    assert bench_blis.finished("blis", stdout, Path("."), 8) == 19366


def test_without_a_blis_binary_it_skips_and_says_why(tmp_path):
    env = {"PATH": "/usr/bin:/bin"}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_blis.py")], capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=60)
    assert (run.returncode, run.stdout) == (0, "skipped: no BLIS binary (KVSIM_BLIS unset); build one with "
                                                "benchmarks/build_blis.sh and set KVSIM_BLIS=/path/to/blis\n")
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_blis.py"), "--blis", str(tmp_path / "none")],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert (run.returncode, run.stdout) == (0, f"skipped: no BLIS binary ({tmp_path}/none not found); build one with "
                                                "benchmarks/build_blis.sh and set KVSIM_BLIS=/path/to/blis\n")
