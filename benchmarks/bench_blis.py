"""Benchmark: kvsim against BLIS (github.com/inference-sim/inference-sim) on the same cluster (issue 38).

    KVSIM_BLIS=/path/to/blis python benchmarks/bench_blis.py [--replicas 8 1] [--runs 5] [--latency-model roofline]
    KVSIM_BLIS=/path/to/blis python benchmarks/bench_blis.py --prepare DIR   # write inputs, print commands

The Azure 2023 conversation trace on Llama-3-70B, TP 2, A100-80GB, block 16, 1,643 KV blocks a
replica, an 8,192-token budget and 256 sequences a step, behind round-robin: `kvsim run ... --no-plots --no-async-scheduling`
against `blis replay` of the same requests (the trace written as BLIS's TraceV2 pair: each row's
arrival in microseconds since the first row, its prompt and output lengths, no prefix group, no
deadline). Runs alternate kvsim, BLIS, kvsim, ... so a drift in the machine's speed hits both; each
figure is a whole process's wall time. Target: kvsim at most 0.5x BLIS's median wall time, at 8
replicas and at 1. Prints one JSON line per replica count, with the commit measured.

BLIS is never needed by tests or CI: without `KVSIM_BLIS` (or `--blis`) naming a built binary this
prints why and exits 0. `benchmarks/build_blis.sh` builds one offline; the binary must sit in its
source tree (it reads `defaults.yaml` and `hardware_config.json` from there; the model's config is
written here), or `KVSIM_BLIS_DATA` must name that tree.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from decimal import ROUND_HALF_EVEN, Decimal
from pathlib import Path

from bench_sim import AZURE_KNOBS, TRACES, commit

# The knobs of bench_sim.py's Azure case, as BLIS spells them (`blis replay --help`).
BLIS_KNOBS = ["--model", "meta-llama/meta-llama-3-70b", "--hardware", "A100-80", "--tp", "2",
              "--block-size-in-tokens", "16", "--total-kv-blocks", "1643", "--max-num-batched-tokens", "8192",
              "--max-num-seqs", "256", "--routing-policy", "round-robin"]
# kvsim sets no max-model-len unless asked; BLIS derives one from the config and drops longer
# requests, so it gets one replica's whole KV capacity: no request of the trace is dropped.
MAX_MODEL_LEN = 1643 * 16
HORIZON_US = 10**15  # run until every request finishes, as kvsim does (replay's default: 2x the last arrival)

# meta-llama/Meta-Llama-3-70B's config.json (the figures kvsim's catalog holds for llama-3-70b).
LLAMA_3_70B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "hidden_size": 8192,
    "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
    "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-05, "vocab_size": 128256,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "attention_bias": False, "mlp_bias": False,
}

TRACEV2_COLUMNS = (
    "request_id,client_id,tenant_id,slo_class,session_id,round_index,prefix_group,prefix_length,streaming,"
    "input_tokens,output_tokens,text_tokens,image_tokens,audio_tokens,video_tokens,reason_ratio,model,"
    "deadline_us,server_input_tokens,arrival_time_us,send_time_us,first_chunk_time_us,last_chunk_time_us,"
    "num_chunks,status,error_message,finish_reason"
)
TRACEV2_HEADER = "trace_version: 3\ntime_unit: microseconds\nmode: real\nwarm_up_requests: 0\n"


def _stamp_us(stamp: str, path: Path, line: int) -> int:
    """Microseconds since the epoch of an Azure `TIMESTAMP` ('YYYY-MM-DD HH:MM:SS.fffffff'), rounded."""
    try:
        whole, _, frac = stamp.partition(".")
        t = dt.datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").replace(tzinfo=dt.timezone.utc)
        micros = (Decimal("0." + (frac or "0")) * 1_000_000).quantize(Decimal(1), ROUND_HALF_EVEN)
    except ArithmeticError as e:
        raise ValueError(f"{path}:{line}: field 'TIMESTAMP': bad fraction {stamp!r}") from e
    except ValueError as e:
        raise ValueError(f"{path}:{line}: field 'TIMESTAMP': expected 'YYYY-MM-DD HH:MM:SS.f', got {stamp!r}") from e
    return int(t.timestamp()) * 1_000_000 + int(micros)


def azure_to_tracev2(src: Path, header: Path, data: Path) -> int:
    """Write the Azure CSV `src` as a BLIS TraceV2 pair (`header` YAML, `data` CSV); returns the rows.

    Arrival is microseconds since the first row, as kvsim's Azure loader counts seconds since it;
    request ids count rows from 0; no prefix group (the trace has no content, and kvsim gives each
    prompt fresh tokens); deadline 0 (no timeout, as kvsim has none)."""
    lines = src.read_text().splitlines()
    if not lines or lines[0].strip() != "TIMESTAMP,ContextTokens,GeneratedTokens":
        raise ValueError(f"{src}:1: expected the header 'TIMESTAMP,ContextTokens,GeneratedTokens'")
    rows, first = [], None
    for line, text in enumerate(lines[1:], start=2):
        if not text.strip():
            continue
        cells = text.split(",")
        if len(cells) != 3:
            raise ValueError(f"{src}:{line}: expected 3 fields, got {len(cells)}")
        t = _stamp_us(cells[0], src, line)
        first = t if first is None else first
        if t < first or (rows and t - first < rows[-1][0]):
            raise ValueError(f"{src}:{line}: field 'TIMESTAMP': {cells[0]!r} is before the row above")
        counts = []
        for name, cell in (("ContextTokens", cells[1]), ("GeneratedTokens", cells[2])):
            if not cell.strip().isdigit():
                raise ValueError(f"{src}:{line}: field '{name}': expected a whole number, got {cell!r}")
            counts.append(int(cell))
        rows.append((t - first, *counts))
    with data.open("w") as f:
        f.write(TRACEV2_COLUMNS + "\n")
        for i, (arrival, prompt, output) in enumerate(rows):
            f.write(f"{i},azure,,,,0,,0,false,{prompt},{output},0,0,0,0,0,,0,0,{arrival},0,0,0,0,ok,,\n")
    header.write_text(TRACEV2_HEADER)
    return len(rows)


def blis_paths(binary: Path) -> Path:
    """The BLIS source tree the binary reads its defaults, hardware and model configs from."""
    data = Path(os.environ.get("KVSIM_BLIS_DATA", binary.resolve().parent))
    if not (data / "defaults.yaml").is_file() or not (data / "hardware_config.json").is_file():
        sys.exit(f"{data}: no defaults.yaml and hardware_config.json (set KVSIM_BLIS_DATA to BLIS's source tree)")
    return data


def prepare(binary: Path, azure: Path, work: Path, replicas: int, latency_model: str | None = None) -> dict[str, list[str]]:
    """Write BLIS's inputs under `work` and return both commands for `replicas` replicas (BLIS with
    `latency_model`, or its default)."""
    data = blis_paths(binary)
    work.mkdir(parents=True, exist_ok=True)
    models = work / "model_configs" / "llama-3-70b"
    models.mkdir(parents=True, exist_ok=True)
    (models / "config.json").write_text(json.dumps(LLAMA_3_70B, indent=1) + "\n")
    if not (work / "azure.csv").exists():
        azure_to_tracev2(azure, work / "azure.yaml", work / "azure.csv")
    blis = [str(binary), "replay", "--trace-header", str(work / "azure.yaml"), "--trace-data", str(work / "azure.csv"),
            *BLIS_KNOBS, "--num-instances", str(replicas), "--max-model-len", str(MAX_MODEL_LEN),
            "--horizon", str(HORIZON_US), "--model-config-folder", str(models),
            "--defaults-filepath", str(data / "defaults.yaml"), "--hardware-config", str(data / "hardware_config.json"),
            *(["--latency-model", latency_model] if latency_model else [])]
    # BLIS steps its instances as vLLM's synchronous Scheduler does (no batch scheduled while one runs),
    # so kvsim runs that scheduler too, not `vllm serve`'s async default
    kvsim = [sys.executable, "-m", "kvsim", "run", str(azure), *AZURE_KNOBS, "--no-plots", "--no-async-scheduling",
             "--router", "round-robin", "--replicas", str(replicas), "--out", str(work / f"kvsim-{replicas}")]
    if replicas == 1:
        kvsim = kvsim[: kvsim.index("--router")] + kvsim[kvsim.index("--replicas") + 2:]
    return {"kvsim": kvsim, "blis": blis}


def measure(argv: list[str]) -> tuple[float, str]:
    """Wall seconds and standard output of one whole process; exits naming it if it fails."""
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return wall, proc.stdout


def finished(name: str, stdout: str, work: Path, replicas: int) -> int:
    """Requests the run finished: BLIS's last metrics block on stdout (the cluster's, or the lone
    instance's), kvsim's summary.json."""
    if name == "blis":
        return int(re.findall(r'"completed_requests": (\d+)', stdout)[-1])
    summary = json.loads((work / f"kvsim-{replicas}" / "summary.json").read_text())
    return summary["cluster"]["overall"]["finished"] if replicas > 1 else summary["finished"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blis", type=Path, default=os.environ.get("KVSIM_BLIS"), help="the BLIS binary ($KVSIM_BLIS)")
    ap.add_argument("--replicas", type=int, nargs="+", default=[8, 1])
    ap.add_argument("--runs", type=int, default=5, help="alternated runs of each simulator per replica count")
    ap.add_argument("--traces", type=Path, default=TRACES)
    ap.add_argument("--latency-model", choices=["trained-physics", "roofline"],
                    help="BLIS's step-time model (default: BLIS's own, trained-physics); kvsim has its cost model")
    ap.add_argument("--prepare", type=Path, help="only write the inputs into this folder and print the commands")
    args = ap.parse_args()
    if args.blis is None or not Path(args.blis).is_file():
        print(f"skipped: no BLIS binary ({'KVSIM_BLIS unset' if args.blis is None else f'{args.blis} not found'}); "
              "build one with benchmarks/build_blis.sh and set KVSIM_BLIS=/path/to/blis")
        return
    azure = args.traces / "azure2023/AzureLLMInferenceTrace_conv.csv"
    with tempfile.TemporaryDirectory() as tmp:
        work = args.prepare or Path(tmp)
        for replicas in args.replicas:
            argv = prepare(Path(args.blis), azure, work, replicas, args.latency_model)
            if args.prepare:
                print(json.dumps({"replicas": replicas, **{k: " ".join(v) for k, v in argv.items()}}))
                continue
            walls: dict[str, list[float]] = {"kvsim": [], "blis": []}
            done: dict[str, int] = {}
            for _ in range(args.runs):
                for name, cmd in argv.items():
                    shutil.rmtree(work / f"kvsim-{replicas}", ignore_errors=True)  # kvsim run refuses a used folder
                    wall, stdout = measure(cmd)
                    walls[name].append(wall)
                    done[name] = finished(name, stdout, work, replicas)
            ratio = statistics.median(walls["kvsim"]) / statistics.median(walls["blis"])
            print(json.dumps({"case": f"{replicas} replica" + "s" * (replicas > 1), "commit": commit(), "runs": args.runs,
                              "commands": {k: " ".join(v) for k, v in argv.items()},
                              "walls_s": {k: [round(w, 2) for w in v] for k, v in walls.items()},
                              "finished": done, "x_blis": round(ratio, 2),
                              "target": "x_blis <= 0.5", "met": ratio <= 0.5}), flush=True)


if __name__ == "__main__":
    main()
