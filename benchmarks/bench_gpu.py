"""Benchmark: the gpu harness's Triton kernels against plain torch on one CUDA GPU, side by side on the same data.

    python benchmarks/bench_gpu.py [--model llama-3-8b] [--dtype float16|bfloat16] [--block-size 16|32]
                                   [--pairs 256] [--gpu NAME] [--only block,swap,write,decode[,pd,fp8]]
                                   [--fp8-dtype fp8|fp8_e5m2] [--block-n 64] [--[no-]cuda-graph] [--json FILE] [--quick [--allow-cpu]]

Figures and targets (reported, not asserted; `--json` records each with its target and pass/fail):
- copy_blocks (copy-on-write) and exchange_blocks (defrag) on the storage of the model's
  layers: >= 90 % of torch's own gather/index copy of the same block ids
  (index_select + index_copy_); the fraction of a plain contiguous device copy of the
  same bytes is reported beside it (no target);
- swap out / in, both swap methods: >= 80 % of a pinned-memory torch copy of the same
  bytes, each way; also as a fraction of the catalog's PCIe bandwidth for the GPU
  (`sim.engine.catalog` GpuSpec.pcie_bw: effective one-direction host <-> device, e.g. 50 GB/s
  for h100-sxm; no target);
- write_kv (K/V by slot mapping, one layer) at several token counts: >= 90 % of torch's
  index_copy_ of the same tokens into the same cache (a bar this script sets: the same
  as the block ops'); indexed assignment (index_put_) reported beside it (no target);
- decode attention against torch's scaled_dot_product_attention over the same tokens
  laid out densely (enable_gqa), contexts 1k/4k/16k, batch 1/8/32/64: <= 1.25x SDPA's
  time at >= 4k context, and >= 70 % of the datasheet HBM bandwidth (K and V bytes
  read) at batch >= 32 (catalog: h100-sxm 3.35 TB/s, h200 4.8 TB/s);
- under CUDA graphs (`--cuda-graph`, on by default with CUDA): write_kv and decode attention
  again, kernel and baseline each replayed from a graph of 10 back-to-back calls, so the
  host's launch path (Python, Triton's launcher: ~75-140 us a decode call) is not timed, as
  vLLM runs decode: `write_kv_t<T>.fraction_of_index_copy_graph`,
  `decode_b<B>_c<C>.sdpa_ratio_graph` and `.hbm_fraction_graph`, with the eager figures'
  targets (every batch at >= 4k context for SDPA). The eager figures are unchanged. A side
  that cannot be captured gets a null figure with its reason (also under "not_measured").
- `pd` (only with `--only pd`, not in the default sections): a P/D KV transfer of a request's
  16/128/512/2048 blocks at random ids, prefill storage -> pinned host -> decode storage
  (swap_blocks' kernel, one device standing in for both), as GB/s and as a ratio to the
  simulator's price: its P/D read (`sim.engine.nixl.KVTransfer.seconds` at SimConfig's NIXL
  defaults, 25 GB/s + 50 us) and its PCIe swap out + in (`CostModel.op_cost_s`, catalog
  pcie_bw); no target but that the blocks arrive intact.
- `fp8` (only with `--only fp8`): decode attention on an FP8 cache (`--fp8-dtype fp8`, e4m3, or
  fp8_e5m2; K scale 0.5, V scale 2, as vLLM's k_scale / v_scale) against the same kernel on the
  16-bit cache of the same values, at the decode points: `decode_fp8_b<B>_c<C>.time_vs_16bit`
  (half the bytes: about 0.5 where decode is bandwidth-bound) and `.hbm_fraction` of the FP8
  bytes it reads, eager and under CUDA graphs (`_graph`); no targets. Each point's output is
  checked against SDPA over the dequantized values (`max_abs_diff_vs_sdpa` in the results).
Figures with no target carry "target": null and "pass": null; figures not measured carry
"value": null, "pass": null and a "reason".

Time per point adapts (about 0.2 s of calls each, fewer for big points, as much again
for the graph replays); a full run took about a minute on an H100 before the graph
figures (`--no-cuda-graph` still runs that); `--only write,decode` with the graphs took 10 s
there, `--only pd` 8 s. Without CUDA it says so and exits 0, unless `--quick --allow-cpu`: then
everything is tiny and runs on CPU under Triton's interpreter (TRITON_INTERPRET=1),
which only exercises the code paths (the timings mean nothing; there are no CUDA graphs,
so no `_graph` figures unless `--cuda-graph` asks for them, and then they are null).
`--quick` on a GPU is the same tiny run, compiled (a graph of 2 calls, replayed once).

This file is the command line, the plan of points and the record; the measurements
(one function per kernel family) are in `gpu_benches.py` beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path

# NOTE: a sibling file, found because this file runs as a script (its folder is sys.path[0])
from gpu_benches import (
    Bench,
    Figures,
    Plan,
    bench_block_ops,
    bench_decode,
    bench_decode_fp8,
    bench_pd_transfer,
    bench_write_kv,
)

SECTIONS = ("block", "swap", "write", "decode")  # the default run
OPT_IN = ("pd", "fp8")  # only when --only names them


def make_plan(m, pairs: int, quick: bool, cuda_graph: bool = False) -> Plan:
    """The model's own shape and the full point grids, or tiny ones for `--quick`."""
    if quick:
        group = m.num_heads // m.num_kv_heads
        return Plan(2, 2 * group, 2, 32, 48 if m.sliding_window else None, 4, (1, 8), (1, 4), (32, 128),
                    128, 4, 0.0, pd_blocks=(2, 8), cuda_graph=cuda_graph)
    return Plan(m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim, m.sliding_window, pairs,
                (1, 16, 256, 4096, 16384), (1, 8, 32, 64), (1024, 4096, 16384), 4096, 32, 0.2,
                pd_blocks=(16, 128, 512, 2048), cuda_graph=cuda_graph)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
    ap.add_argument("--block-size", type=int, choices=(16, 32), default=16)
    ap.add_argument("--pairs", type=int, default=256, help="block pairs per batched block op")
    ap.add_argument("--gpu", default=None, help="datasheet for the HBM/PCIe fractions (default: detected)")
    ap.add_argument("--only", default=",".join(SECTIONS),
                    help=f"comma-separated sections to run (default: {','.join(SECTIONS)}; also {','.join(OPT_IN)})")
    ap.add_argument("--fp8-dtype", choices=("fp8", "fp8_e5m2"), default="fp8",
                    help="the `fp8` section's cache: vLLM's --kv-cache-dtype fp8 (e4m3) or fp8_e5m2")
    ap.add_argument("--block-n", type=int, default=64, help="decode_attention's tokens per tile")
    ap.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                    help="also time write_kv and decode attention (and their baselines) replayed from CUDA graphs "
                         "(default: on with CUDA)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, one call per point (a smoke test)")
    ap.add_argument("--allow-cpu", action="store_true",
                    help="with --quick: without CUDA, run on CPU under Triton's interpreter")
    args = ap.parse_args(argv)
    sections = tuple(s.strip() for s in args.only.split(",") if s.strip())
    if bad := [s for s in sections if s not in SECTIONS + OPT_IN]:
        ap.error(f"--only: unknown section(s) {', '.join(bad)}; choose from {', '.join(SECTIONS + OPT_IN)}")
    if args.allow_cpu and not args.quick:
        ap.error("--allow-cpu needs --quick (full-size points under the interpreter would take hours)")
    try:
        import torch
    except ImportError:
        print("bench_gpu: torch is not installed (pip install -e '.[gpu]'); nothing to measure")
        return 0
    if not torch.cuda.is_available():
        if not args.allow_cpu:
            print("bench_gpu: no CUDA GPU (torch.cuda.is_available() is False); the kernels are only "
                  "checked for correctness on CPU (pytest tests/gpu). Nothing to measure "
                  "(--quick --allow-cpu runs a tiny smoke test under Triton's interpreter).")
            return 0
        if "triton" not in sys.modules:
            os.environ.setdefault("TRITON_INTERPRET", "1")
    import kvsim.gpu.kernels  # noqa: F401  (chooses compiled or interpreted Triton before anything imports triton)

    results = run(args, sections)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def run(args, sections: tuple[str, ...] = SECTIONS) -> dict:
    """Every benchmark section asked for; returns the JSON-able record."""
    import torch
    import triton

    from kvsim.gpu.calibrate import detect_gpu
    from kvsim.gpu.kernels import interpreting
    from kvsim.gpu.replay import DTYPES  # gpu-replay's --dtype names
    from kvsim.sim.engine.catalog import get_gpu, get_model

    t_start = time.perf_counter()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, args.dtype)
    gpu_name = detect_gpu(dev, args.gpu)
    spec, m = get_gpu(gpu_name), get_model(args.model)
    cuda_graph = cuda if args.cuda_graph is None else args.cuda_graph
    plan = make_plan(m, args.pairs, args.quick, cuda_graph)
    device_name = torch.cuda.get_device_name(dev) if cuda else f"cpu ({platform.processor() or platform.machine()})"
    print(f"{device_name}: datasheet {spec.name} (sim.engine.catalog: HBM {spec.hbm_bw / 1e12:.2f} TB/s, PCIe "
          f"{spec.pcie_bw / 1e9:.0f} GB/s effective one direction); torch {torch.__version__}, triton "
          f"{triton.__version__}{', Triton interpreter' if interpreting() else ''}")
    print(f"{m.name}{' (quick: tiny shapes)' if args.quick else ''}: {plan.layers} layers x {plan.kv_heads} KV heads "
          f"x {plan.head_dim} dims, {plan.heads} query heads, window {plan.window}, block size {args.block_size}, "
          f"{args.dtype}")
    fig = Figures()
    out: dict = {
        "device": device_name, "gpu": spec.name, "torch": torch.__version__, "triton": triton.__version__,
        "cuda": torch.version.cuda, "argv": list(sys.argv), "command": shlex.join(sys.argv),
        "dtype": args.dtype, "model": m.name, "block_size": args.block_size, "quick": args.quick,
        "interpreted": interpreting(), "sections": list(sections), "decode_block_n": args.block_n,
        "cuda_graph": cuda_graph,
        "datasheet": {"name": spec.name, "hbm_bw": spec.hbm_bw, "pcie_bw": spec.pcie_bw,
                      "source": f"sim.engine.catalog.GPUS[{spec.name!r}] (hbm_bw, pcie_bw: effective one direction)"},
        "plan": asdict(plan),
        "results": {},
    }
    bench = Bench(dev, plan.seconds_per_point)
    if "block" in sections or "swap" in sections:
        out["results"].update(bench_block_ops(bench, fig, plan, args.block_size, dtype, sections, spec.pcie_bw))
    if "write" in sections:
        out["results"].update(bench_write_kv(bench, fig, plan, args.block_size, dtype))
    if "decode" in sections:
        out["results"].update(bench_decode(bench, fig, plan, args.block_size, dtype, spec.hbm_bw, args.block_n))
    if "fp8" in sections:
        out["fp8_dtype"] = args.fp8_dtype
        out["results"].update(bench_decode_fp8(bench, fig, plan, args.block_size, dtype, spec.hbm_bw, args.block_n,
                                               DTYPES[args.fp8_dtype]))
    if "pd" in sections:
        out["results"].update(bench_pd_transfer(bench, fig, plan, args.block_size, dtype, m, spec))
    out["figures"] = fig.rows
    out["not_measured"] = fig.not_measured()
    targeted = [r["pass"] for r in fig.rows.values() if r["pass"] is not None]
    out["passed"] = sum(targeted)
    out["failed"] = len(targeted) - sum(targeted)
    out["all_pass"] = all(targeted)
    out["seconds"] = time.perf_counter() - t_start
    missing = f"; {len(out['not_measured'])} figures not measured" if out["not_measured"] else ""
    print(f"{out['passed']} of {len(targeted)} targets met{missing} ({out['seconds']:.0f} s)")
    return out


if __name__ == "__main__":
    sys.exit(main())
