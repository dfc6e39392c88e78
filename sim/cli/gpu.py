"""`kvsim gpu-replay` and `kvsim calibrate`: the GPU validation harness (torch is imported only when they run)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer

from kvsim.sim.cli.common import check_output, fail, staged_file

_DEVICE_HELP = "cuda|cpu (default: cuda if available)"
_KERNELS_HELP = ("triton|torch: Triton kernels (on cpu under Triton's interpreter: slow) or plain torch ops "
                 "(default: triton on cuda, torch on cpu)")


def _need(*modules: str) -> None:
    """Fail with the install line if any of `modules` is missing."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise fail(f"this command needs {' and '.join(missing)}; install with: pip install -e '.[gpu]'")


def _device(device: str | None, needs: tuple[str, ...] = ("torch", "triton")) -> str:
    """Resolve --device and, for cpu, switch Triton to its interpreter before any kernel is imported."""
    if device not in (None, "cuda", "cpu"):
        raise fail(f"--device must be cuda or cpu, got {device!r}")
    _need(*needs)
    import torch  # NOTE: not triton yet: TRITON_INTERPRET must be set before triton is imported
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise fail("--device cuda: no CUDA device (torch.cuda.is_available() is False); use --device cpu")
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    return device


def _scales(text: str | None) -> tuple[float, float]:
    """`--kv-scale`: 'K,V' or one number for both (checked as a storage checks them)."""
    if text is None:
        return 1.0, 1.0
    parts = text.split(",")
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise fail(f"--kv-scale {text!r}: a number, or two as K,V") from None
    if len(values) not in (1, 2):
        raise fail(f"--kv-scale {text!r}: a number, or two as K,V")
    return (values[0], values[-1])


def gpu_replay(
    run_dir: Annotated[Path, typer.Argument(help="run folder with ops.parquet, op_tokens.parquet, config.json")],
    device: Annotated[str | None, typer.Option("--device", "-d", help=_DEVICE_HELP)] = None,
    layers: Annotated[int, typer.Option("--layers", help="layers of the replay storage")] = 2,
    kv_heads: Annotated[int, typer.Option("--kv-heads", help="KV heads per layer")] = 2,
    head_dim: Annotated[int, typer.Option("--head-dim", help="dimension per head")] = 16,
    q_per_kv: Annotated[int, typer.Option("--q-per-kv", help="query heads per KV head (GQA)")] = 2,
    check_every: Annotated[int, typer.Option("--check-every", help="verify every N-th step")] = 1,
    attention_layers: Annotated[int | None, typer.Option(
        "--attention-layers", help="layers whose decode output is checked against dense attention (default all)")] = None,
    attention_sample: Annotated[int | None, typer.Option(
        "--attention-sample", help="compare at most N of a step's decodes' attention, in turn (default all): "
                                   "the dense reference spans each decode's context")] = None,
    dtype: Annotated[str | None, typer.Option("--dtype", help="float16|bfloat16|float32, or an FP8 cache: fp8 (e4m3)|fp8_e5m2")] = None,
    kv_scale: Annotated[str | None, typer.Option(
        "--kv-scale", help="an FP8 cache's scales, 'K,V' or one for both (vLLM's k_scale, v_scale): powers of two [default: 1]")] = None,
    swap_method: Annotated[str, typer.Option("--swap-method", help="kernel|torch")] = "kernel",
    kernels: Annotated[str | None, typer.Option("--kernels", help=_KERNELS_HELP)] = None,
    check: Annotated[str, typer.Option(
        "--check", help="full: read each written sequence back whole; touched: only the table entries an op "
                        "changed since its last check (exact while nothing but the replayed ops writes the storage)")] = "full",
    inject_faults: Annotated[int, typer.Option(
        "--inject-faults", help="corrupt N ops of the stream first (every fault kind the stream allows); "
                                "exit 1 unless every one is reported as a mismatch")] = 0,
    seed: Annotated[int, typer.Option("--seed", help="seed of --inject-faults")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="print the report as one JSON object")] = False,
    save: Annotated[Path | None, typer.Option("--save", help="also write the whole report (per-step times) as JSON")] = None,
) -> None:
    """Replay a run's block ops on paged KV storage and verify every cached token exactly."""
    if save is not None:
        check_output(save)
    if swap_method not in ("kernel", "torch"):
        raise fail(f"--swap-method must be kernel or torch, got {swap_method!r}")
    if kernels not in (None, "triton", "torch"):
        raise fail(f"--kernels must be triton or torch, got {kernels!r}")
    if check not in ("full", "touched"):
        raise fail(f"--check must be full or touched, got {check!r}")
    dev = _device(device, ("torch",))
    kernels = kernels or ("torch" if dev == "cpu" else "triton")
    if kernels == "triton":
        _need("triton")
    for name, v in (("--layers", layers), ("--kv-heads", kv_heads), ("--head-dim", head_dim),
                    ("--q-per-kv", q_per_kv), ("--check-every", check_every),
                    ("--attention-sample", 1 if attention_sample is None else attention_sample)):
        if v < 1:
            raise fail(f"{name} must be >= 1, got {v}")
    if attention_sample is not None and not (attention_layers if attention_layers is not None else kernels == "triton"):
        why = "--attention-layers 0" if attention_layers == 0 else "the torch kernels' default"
        raise fail(f"--attention-sample {attention_sample} picks decodes to compare against dense attention, and this "
                   f"replay compares none ({why}): give --attention-layers N too, or drop it")
    if inject_faults < 0:
        raise fail(f"--inject-faults must be >= 0, got {inject_faults}")
    if inject_faults and (check_every != 1 or check != "full"):
        raise fail("--inject-faults needs every step read whole (--check-every 1, --check full): "
                   "the injector keeps only faults such a replay must catch")
    from kvsim.gpu.replay import RunFilesError, load_run, replay_ops
    from kvsim.sim.engine.config import ConfigError

    faults: list = []
    try:
        ops, tokens, config = load_run(run_dir, rows=True)
        if inject_faults:
            from kvsim.gpu.faults import inject_faults as inject
            from kvsim.sim.engine.config import KV_GROUPS_KEY

            if config.get(KV_GROUPS_KEY):
                raise ValueError(f"--inject-faults: {run_dir}'s stream has {len(config[KV_GROUPS_KEY])} KV-cache groups, "
                                 "and the fault injector knows one block table a sequence; replay it without faults "
                                 "(or record the run with --disable-hybrid-kv-cache-manager)")

            ops, faults = inject(ops, inject_faults, seed, tokens=tokens, block_size=config["block_size"])
        rep = replay_ops(ops, tokens, config, dev, layers, kv_heads, head_dim, check_every, dtype, q_per_kv=q_per_kv,
                         swap_method=swap_method, strict=False, run=str(run_dir), attention_layers=attention_layers,
                         kernels=kernels, check=check, progress=lambda line: typer.echo(line, err=True),
                         kv_scales=_scales(kv_scale), attention_sample=attention_sample)
    except (RunFilesError, ConfigError, ValueError) as e:
        raise fail(str(e)) from None
    report = rep.as_dict()
    if faults:
        report["faults"], missed = _fault_results(faults, rep)
    if save is not None:
        with staged_file(save) as tmp:
            tmp.write_text(json.dumps(report) + "\n")
    if as_json:
        typer.echo(json.dumps(report))
    else:
        typer.echo(rep.format())
        if faults:
            from kvsim.gpu.faults import format_faults

            typer.echo("\ninjected faults\n" + format_faults(faults, [f["caught"] for f in report["faults"]]))
    if faults:
        if missed:
            typer.echo(f"fault injection: {len(missed)} of {len(faults)} injected faults not reported, "
                       f"the first: {missed[0]}", err=True)
            raise typer.Exit(1)
    elif rep.mismatches:
        typer.echo(f"integrity error: {rep.errors[0]}", err=True)
        raise typer.Exit(1)


def _fault_results(faults: list, rep) -> tuple[list[dict], list[str]]:
    """Each injected fault as JSON with whether the replay caught it, and the missed ones' descriptions."""
    from dataclasses import asdict

    from kvsim.gpu.faults import attribute

    caught = attribute(faults, rep)
    rows = [asdict(f) | {"caught": c} for f, c in zip(faults, caught, strict=True)]
    return rows, [f"{f.kind} at step {f.step} (op {f.index}): {f.what}" for f, c in zip(faults, caught, strict=True)
                  if not c]


def calibrate(
    device: Annotated[str | None, typer.Option("--device", "-d", help=_DEVICE_HELP)] = None,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="write the profile here (default: stdout)")] = None,
    model: Annotated[str, typer.Option("--model", "-m", help="model whose block the op costs are for")] = "llama-3-8b",
    gpu: Annotated[str | None, typer.Option("--gpu", help="datasheet the efficiencies divide by (default: detected)")] = None,
    block_size: Annotated[int, typer.Option("--block-size", "-b", help="tokens per block")] = 16,
    rows: Annotated[Path | None, typer.Option("--rows", help="also write every measurement here (JSON)")] = None,
    refit: Annotated[Path | None, typer.Option(
        "--refit", help="no measuring: build the profile from the measurements an earlier --rows wrote")] = None,
    replay: Annotated[list[str] | None, typer.Option(
        "--replay", help="a `gpu-replay --save` report (repeatable) to fit the per-launch cost launch_s to; "
                         "REPORT,CONFIG for a report without its run's config")] = None,
) -> None:
    """Measure the harness's kernels and whole forward steps (on CUDA), fit the cost model to them,
    and write a calibration profile for `kvsim run --calibration`."""
    from kvsim.sim.engine.config import ConfigError, check_block_size

    try:
        check_block_size(block_size)
    except ConfigError as e:
        raise fail(str(e)) from None
    for path in (out, rows):  # before minutes of measuring, not after
        if path is not None:
            check_output(path)
    from kvsim.gpu.report import load_report

    try:
        replays = [load_report(spec) for spec in replay or ()]
    except ValueError as e:
        raise fail(str(e)) from None
    if refit is not None:
        measured, profile = _refit(refit, model, gpu, block_size, replays)
    else:
        dev = _device(device)
        from kvsim.gpu.calibrate import calibrate as measure

        try:
            profile, measured = measure(dev, model, gpu, block_size, replays=replays,
                                        progress=lambda line: typer.echo(line, err=True))
        except ConfigError as e:
            raise fail(str(e)) from None
    from kvsim.gpu.calibrate import format_rows

    text = json.dumps(profile, indent=2) + "\n"
    if rows is not None:
        with staged_file(rows) as tmp:
            tmp.write_text(json.dumps(measured, indent=1) + "\n")
    if out is None:
        typer.echo(text, nl=False)
        typer.echo(format_rows(measured), err=True)
        return
    with staged_file(out) as tmp:
        tmp.write_text(text)
    typer.echo(format_rows(measured))
    typer.echo(f"wrote {out}")


def _refit(path: Path, model: str, gpu: str | None, block_size: int,
           replays: list[dict]) -> tuple[list[dict], dict]:
    """Measurements from `path` and the profile built from them; bad files fail naming the file."""
    from kvsim.sim.engine.config import ConfigError
    from kvsim.workloads.files import read_json

    try:
        measured = read_json(path)
    except ValueError as e:
        raise fail(str(e)) from None
    if not isinstance(measured, list) or not all(isinstance(r, dict) and "name" in r for r in measured):
        raise fail(f"{path}: expected the list of measurements `kvsim calibrate --rows` writes")
    from kvsim.gpu.calibrate import build_profile, gpu_of_name

    device = next((r["device"] for r in measured if r.get("name") == "forward_step"), None)
    name = gpu or gpu_of_name(device)
    try:
        return measured, build_profile(measured, model, name, block_size, cuda=device is not None, replays=replays)
    except (ConfigError, KeyError, ValueError) as e:
        raise fail(f"{path}: {e}") from None


def register(app: typer.Typer) -> None:
    app.command("gpu-replay")(gpu_replay)
    app.command("calibrate")(calibrate)
