"""Measure the harness's kernels and write the calibration profile `kvsim run --calibration` reads.

The profile follows `sim.engine.cost_model`'s schema exactly:

    {"version": 1, "device": ..., "efficiency": {"compute": .., "memory": ..},
     "overhead_s": .., "op_cost_s": {"copy": .., "swap_out": .., "swap_in": .., "move": ..}}

- op_cost_s: seconds per block op of the simulated model's block (all layers, K
  and V), from the bandwidth each batched kernel reached (swaps: the faster of
  the two swap methods).
- efficiency.memory: the best HBM bandwidth decode attention reached over the
  batch x context grid, as a fraction of the GPU's datasheet bandwidth.
- efficiency.compute: an fp16 matmul's FLOP/s as a fraction of the datasheet peak.
- overhead_s: host time per step is not something kernels measure; the cost
  model's default, or the launch floor of a one-token step if that is larger.

On CUDA the storage has the model's geometry; on CPU (Triton's interpreter)
everything is tiny and the numbers only exercise the code path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvsim.gpu.kernels import (
    SWAP_METHODS,
    copy_blocks,
    decode_attention,
    exchange_blocks,
    swap_blocks,
    write_kv,
)
from kvsim.gpu.storage import PagedKVStorage
from kvsim.gpu.timing import time_call


@dataclass(frozen=True)
class Geometry:
    layers: int
    kv_heads: int
    heads: int
    head_dim: int
    block_size: int
    pairs: int  # block pairs per batched block op
    write_tokens: tuple[int, ...]
    decode_grid: tuple[tuple[int, int], ...]  # (batch, context)
    matmul: int
    iters: int


def _geometry(device: torch.device, model, block_size: int) -> Geometry:
    if device.type == "cuda":
        grid = tuple((b, c) for b in (1, 8, 32, 64) for c in (1024, 4096, 16384) if b * c <= 1 << 20)
        return Geometry(model.num_layers, model.num_kv_heads, model.num_heads, model.head_dim, block_size,
                        128, (1, 64, 1024, 8192), grid, 8192, 20)
    return Geometry(2, 2, 4, 16, min(block_size, 4), 4, (1, 16), ((1, 16), (2, 64)), 64, 1)


def detect_gpu(device: torch.device, gpu: str | None = None) -> str:
    """The catalogue name of `gpu`, or of the CUDA device by its name (default h100-sxm)."""
    if gpu is not None or device.type != "cuda":
        return gpu or "h100-sxm"
    return gpu_of_name(torch.cuda.get_device_name(device))


def gpu_of_name(device_name: str | None) -> str:
    """The catalogue GPU of a device name as torch reports it (h100-sxm if unknown)."""
    name = (device_name or "").lower()
    for key, spec in (("h200", "h200"), ("h100", "h100-sxm"), ("a100", "a100-80g"), ("l40s", "l40s")):
        if key in name:
            return spec
    return "h100-sxm"


class _Bench:
    """Times calls on one device and keeps every measurement as a row."""

    def __init__(self, device: torch.device, iters: int):
        self.device, self.iters = device, iters
        self.rows: list[dict] = []

    def __call__(self, name: str, fn, bytes_moved: float, **params) -> float:
        """Seconds per call of fn; the row records bytes/s too."""
        s = time_call(fn, self.device, warmup=1 if self.iters == 1 else 3, iters=self.iters)
        self.rows.append({"name": name, **params, "seconds": s, "bytes": bytes_moved,
                          "GB_per_s": bytes_moved / s / 1e9})
        return s


def _block_op_rates(bench: _Bench, g: Geometry, dtype: torch.dtype) -> dict[str, float]:
    """Blocks per second (in bytes of this geometry's block) each batched block op ran at;
    swaps take the faster method."""
    n, dev = g.pairs, bench.device
    st = PagedKVStorage(g.layers, 2 * n + 1, g.block_size, g.kv_heads, g.head_dim, num_cpu_blocks=n,
                        dtype=dtype, device=dev)
    st.gpu.normal_()
    bb = st.block_bytes
    pairs = torch.stack([torch.arange(1, n + 1), torch.arange(n + 1, 2 * n + 1)], 1).to(dev)
    rate = {
        "copy": n * bb / bench("copy_blocks", lambda: copy_blocks(st.gpu, st.gpu, pairs), 2 * n * bb, pairs=n),
        "move": n * bb / bench("exchange_blocks", lambda: exchange_blocks(st.gpu, pairs), 4 * n * bb, pairs=n),
    }
    out_pairs = torch.stack([torch.arange(1, n + 1), torch.arange(n)], 1).to(dev)
    in_pairs = out_pairs.flip(1).contiguous()
    for kind, src, dst, p in (("swap_out", st.gpu, st.cpu, out_pairs), ("swap_in", st.cpu, st.gpu, in_pairs)):
        rate[kind] = max(
            n * bb / bench(kind, lambda s=src, d=dst, k=meth, p=p: swap_blocks(s, d, p if k == "kernel" else p.cpu(), k),
                           n * bb, pairs=n, method=meth)
            for meth in SWAP_METHODS
        )
    return rate


def _write_kv(bench: _Bench, g: Geometry, dtype: torch.dtype) -> None:
    for t in g.write_tokens:
        kv = torch.randn((t, g.kv_heads, g.head_dim), dtype=dtype, device=bench.device)
        cache = torch.empty((2 * t // g.block_size + 1, g.block_size, g.kv_heads, g.head_dim), dtype=dtype,
                            device=bench.device)
        slots = torch.randperm(cache.shape[0] * g.block_size, device=bench.device)[:t]
        bench("write_kv", lambda kv=kv, c=cache, s=slots: write_kv(kv, kv, c, c, s),
              t * 2 * kv[0].numel() * kv.element_size(), tokens=t)


def _decode_best_rate(bench: _Bench, g: Geometry, dtype: torch.dtype) -> float:
    """The highest bytes/s decode attention read K/V at over the batch x context grid."""
    best = 0.0
    for batch, ctx in g.decode_grid:
        pages = -(-ctx // g.block_size)
        kc = torch.randn((batch * pages + 1, g.block_size, g.kv_heads, g.head_dim), dtype=dtype, device=bench.device)
        vc = torch.randn_like(kc)
        tables = (torch.randperm(batch * pages, device=bench.device) + 1).to(torch.int32).view(batch, pages)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=bench.device)
        q = torch.randn((batch, g.heads, g.head_dim), dtype=dtype, device=bench.device)
        nbytes = batch * ctx * 2 * g.kv_heads * g.head_dim * kc.element_size()
        s = bench("decode_attention", lambda q=q, kc=kc, vc=vc, t=tables, n=lens, c=ctx:
                  decode_attention(q, kc, vc, t, n, max_context=c), nbytes, batch=batch, context=ctx)
        best = max(best, nbytes / s)
    return best


def _matmul_flops(bench: _Bench, g: Geometry) -> float:
    dtype = torch.float16 if bench.device.type == "cuda" else torch.float32
    a = torch.randn((g.matmul, g.matmul), dtype=dtype, device=bench.device)
    flops = 2 * g.matmul**3 / bench("matmul", lambda: a @ a, 0.0, size=g.matmul)
    bench.rows[-1]["TFLOP_per_s"] = flops / 1e12
    return flops


def _launch_floor(bench: _Bench, g: Geometry, dtype: torch.dtype) -> float:
    """Seconds of a one-token decode step's launches: a K/V write and a decode per layer."""
    dev = bench.device
    q = torch.randn((1, g.heads, g.head_dim), dtype=dtype, device=dev)
    kv = q[:, : g.kv_heads]
    cache = torch.zeros((2, g.block_size, g.kv_heads, g.head_dim), dtype=dtype, device=dev)
    one = torch.ones((1, 1), dtype=torch.int32, device=dev)
    slot = torch.full((1,), g.block_size, dtype=torch.int64, device=dev)

    def step() -> None:
        for _ in range(g.layers):
            write_kv(kv, kv, cache, cache, slot)
            decode_attention(q, cache, cache, one, one[0], max_context=1)

    return bench("launch_floor_step", step, 0.0, layers=g.layers)


STEP_MODELS = (("llama-3-8b", 1), ("llama-3-70b", 2))  # whole forward steps measured on CUDA (model, TP)


def calibrate(device: str = "cuda", model: str = "llama-3-8b", gpu: str | None = None,
              block_size: int = 16, step_models: tuple[tuple[str, int], ...] | None = None,
              progress=None, replays: Sequence[Mapping] = ()) -> tuple[dict, list[dict]]:
    """Run the measurements; returns (the calibration profile, every measurement as a dict).

    On CUDA this also times whole synthetic forward steps of `step_models` (`gpu.forward_step`),
    from which the cost model's efficiencies and overhead are fitted (`gpu.accuracy.fit_steps`).
    """
    from kvsim.gpu.forward_step import run_grid
    from kvsim.sim.engine.catalog import get_model

    dev = torch.device(device)
    gpu_name = detect_gpu(dev, gpu)
    m = get_model(model)
    g = _geometry(dev, m, block_size)
    bench = _Bench(dev, g.iters)
    dtype = torch.float16
    _block_op_rates(bench, g, dtype)
    _write_kv(bench, g, dtype)
    _decode_best_rate(bench, g, dtype)
    _matmul_flops(bench, g)
    _launch_floor(bench, g, dtype)
    rows = [{**r, "block_bytes": _geometry_block_bytes(g, dtype)} if r["name"] in _OP_ROWS else r
            for r in bench.rows]
    if step_models is None:
        step_models = STEP_MODELS if dev.type == "cuda" else ()
    for name, tp in step_models:
        for r in run_grid(name, tp, dev, progress=progress):
            rows.append({**r, "name": "forward_step", "seconds": r["measured_s"], "bytes": 0.0})
    profile = build_profile(rows, model, gpu_name, block_size, cuda=dev.type == "cuda", replays=replays)
    return profile, rows


_OP_ROWS = {"copy_blocks": ("copy", 2), "exchange_blocks": ("move", 4), "swap_out": ("swap_out", 1),
            "swap_in": ("swap_in", 1)}  # row name -> (op kind, bytes moved per block of the op)


def _geometry_block_bytes(g: Geometry, dtype: torch.dtype) -> int:
    return 2 * g.layers * g.block_size * g.kv_heads * g.head_dim * torch.empty((), dtype=dtype).element_size()


def build_profile(rows: list[dict], model: str, gpu: str, block_size: int = 16, cuda: bool = True,
                  replays: Sequence[Mapping] = ()) -> dict:
    """The calibration profile from measurements (also those of an earlier run: `kvsim calibrate --refit`).

    op_cost_s: the model's block over the best bandwidth each block op reached. Efficiencies,
    serial fraction and overhead: fitted to the forward steps when there are any; else the
    best decode bandwidth and matmul rate as fractions of the datasheet, and the launch floor.
    launch_s: fitted to `replays` (gpu-replay reports holding their run's config) beside the
    bytes the rest of this profile charges (`gpu.accuracy.fit_launches`); absent without them.
    """
    from kvsim.gpu.accuracy import fit_steps
    from kvsim.sim.engine.catalog import get_gpu, get_model
    from kvsim.sim.engine.cost_model import (
        CALIBRATION_VERSION,
        DEFAULT_OVERHEAD_S,
        OP_KINDS,
        CostModel,
    )

    spec = get_gpu(gpu)
    block_bytes = CostModel(get_model(model), spec, block_size=block_size).kv_bytes_per_block
    rate: dict[str, float] = {}
    for r in rows:
        if r["name"] in _OP_ROWS:
            kind, per_block = _OP_ROWS[r["name"]]
            rate[kind] = max(rate.get(kind, 0.0), r["bytes"] / per_block / r["seconds"])
    missing = [k for k in OP_KINDS if k not in rate]
    if missing:
        raise ValueError(f"the measurements lack the block ops {', '.join(missing)}")
    profile = {"version": CALIBRATION_VERSION, "device": spec.name if cuda else "cpu-interpreter"}
    steps = [r for r in rows if r["name"] == "forward_step"]
    if steps:
        cal = fit_steps(steps, spec.name)
        profile["efficiency"] = {"compute": cal.compute, "attention": cal.attention, "memory": cal.memory}
        profile["serial_fraction"] = cal.serial_fraction
        profile["overhead_s"] = cal.overhead_s
    else:
        decode = max(r["bytes"] / r["seconds"] for r in rows if r["name"] == "decode_attention")
        matmul = max(r["TFLOP_per_s"] * 1e12 for r in rows if r["name"] == "matmul")
        floor = max(r["seconds"] for r in rows if r["name"] == "launch_floor_step")
        profile["efficiency"] = {"compute": min(1.0, matmul / spec.peak_flops),
                                 "memory": min(1.0, decode / spec.hbm_bw)}
        profile["overhead_s"] = max(DEFAULT_OVERHEAD_S, floor)
    profile["op_cost_s"] = {k: block_bytes / rate[k] for k in OP_KINDS}
    if replays:
        from kvsim.gpu.accuracy import fit_launches
        from kvsim.gpu.predict import predictor
        from kvsim.sim.engine.cost_model import parse_calibration

        cal = parse_calibration(profile, Path("(the profile being built)"))
        profile["launch_s"] = fit_launches([(r, predictor(r["config"], calibration=cal)) for r in replays])
    return profile


def format_rows(rows: list[dict]) -> str:
    """The measurements as one line each (forward steps: one line per model)."""
    lines = []
    for r in rows:
        if r["name"] == "forward_step":
            continue
        params = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                           for k, v in r.items() if k not in ("name", "seconds", "bytes", "GB_per_s", "block_bytes"))
        rate = f"{r['bytes'] / r['seconds'] / 1e9:10.2f} GB/s" if r["bytes"] else " " * 15
        lines.append(f"{r['name']:<18} {r['seconds'] * 1e6:12.1f} us {rate}  {params}")
    steps: dict[tuple, int] = {}
    for r in rows:
        if r["name"] == "forward_step":
            steps[(r["model"], r["tp"])] = steps.get((r["model"], r["tp"]), 0) + 1
    lines += [f"forward_step       {n} steps of {model} tp {tp}" for (model, tp), n in steps.items()]
    return "\n".join(lines)
