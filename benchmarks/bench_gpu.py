"""Benchmark: the gpu harness's Triton kernels against plain torch on one CUDA GPU.

    python benchmarks/bench_gpu.py [--model llama-3-8b] [--block-size 16] [--pairs 256] [--gpu NAME] [--json FILE]

Targets (reported, not asserted):
- block copy and defrag exchange >= 90 % of a torch device-to-device copy of the same bytes;
- swap out / in >= 80 % of a pinned torch copy of the same bytes, each way (both swap methods);
- decode attention <= 1.25x dense SDPA at >= 4k context, and >= 70 % of the datasheet
  HBM bandwidth at batch >= 32.
Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--pairs", type=int, default=256, help="block pairs per batched block op")
    ap.add_argument("--gpu", default=None, help="datasheet for the HBM fraction (default: detected)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("bench_gpu: torch is not installed (pip install -e '.[gpu]'); nothing to measure")
        return 0
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA GPU (torch.cuda.is_available() is False); the kernels are only "
              "checked for correctness on CPU (pytest tests/gpu). Nothing to measure.")
        return 0
    results = run(args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


def _verdict(ok: bool) -> str:
    return "meets target" if ok else "MISSES target"


def run(args) -> dict:
    """All three benchmarks; returns their numbers."""
    import torch

    from gpu.calibrate import detect_gpu
    from sim.catalog import get_gpu, get_model

    dev = torch.device("cuda")
    spec, m = get_gpu(detect_gpu(dev, args.gpu)), get_model(args.model)
    print(f"{torch.cuda.get_device_name(dev)} ({spec.name} datasheet: {spec.hbm_bw / 1e12:.2f} TB/s HBM), "
          f"{m.name} blocks: {m.num_layers} layers x {m.num_kv_heads} KV heads x {m.head_dim} dims, "
          f"block size {args.block_size}, fp16")
    out: dict = {"device": torch.cuda.get_device_name(dev), "gpu": spec.name, "model": m.name}
    out.update(bench_block_ops(dev, m, args.block_size, args.pairs))
    out.update(bench_decode(dev, m, args.block_size, spec.hbm_bw))
    return out


def _time(fn, dev) -> float:
    from gpu.timing import time_call

    return time_call(fn, dev, warmup=5, iters=50)


def bench_block_ops(dev, m, block_size: int, n: int) -> dict:
    """Copy and exchange against a device copy of the same bytes; swaps against pinned torch copies."""
    import torch

    from gpu.kernels import SWAP_METHODS, copy_blocks, exchange_blocks, swap_blocks
    from gpu.storage import PagedKVStorage

    out = {}
    st = PagedKVStorage(m.num_layers, 2 * n + 1, block_size, m.num_kv_heads, m.head_dim,
                        num_cpu_blocks=n, dtype=torch.float16, device=dev)
    st.gpu.normal_()
    bb = st.block_bytes
    ids = torch.randperm(2 * n, device=dev) + 1
    pairs = torch.stack([ids[:n], ids[n:]], 1).contiguous()
    src = torch.empty(n * bb, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    t_dev1 = _time(lambda: dst[: n * bb // 2].copy_(src[: n * bb // 2]), dev)
    t_dev2 = _time(lambda: dst.copy_(src), dev)  # an exchange moves twice the bytes
    for name, fn, t_base, nbytes in (
        ("copy_blocks", lambda: copy_blocks(st.gpu, st.gpu, pairs), t_dev1, 2 * n * bb),
        ("exchange_blocks", lambda: exchange_blocks(st.gpu, pairs), t_dev2, 4 * n * bb),
    ):
        tk = _time(fn, dev)
        frac = t_base / tk
        print(f"{name:<16} {n} pairs  {tk * 1e6:9.1f} us  {nbytes / tk / 1e9:8.1f} GB/s  "
              f"{frac:6.1%} of torch device copy  {_verdict(frac >= 0.9)}")
        out[name] = {"seconds": tk, "GB_per_s": nbytes / tk / 1e9, "fraction_of_device_copy": frac}

    host = torch.empty(n * bb, dtype=torch.uint8, pin_memory=True)
    base = {"swap_out": _time(lambda: host.copy_(src, non_blocking=True), dev),
            "swap_in": _time(lambda: src.copy_(host, non_blocking=True), dev)}
    out_pairs = torch.stack([ids[:n], torch.randperm(n, device=dev)], 1).contiguous()
    for kind, a, b, p in (("swap_out", st.gpu, st.cpu, out_pairs),
                          ("swap_in", st.cpu, st.gpu, out_pairs.flip(1).contiguous())):
        for meth in SWAP_METHODS:
            pp = p if meth == "kernel" else p.cpu()
            tk = _time(lambda a=a, b=b, pp=pp, meth=meth: swap_blocks(a, b, pp, meth), dev)
            frac = base[kind] / tk
            print(f"{kind:<9} {meth:<6} {n} blocks {tk * 1e6:9.1f} us  {n * bb / tk / 1e9:8.1f} GB/s  "
                  f"{frac:6.1%} of pinned torch copy  {_verdict(frac >= 0.8)}")
            out[f"{kind}_{meth}"] = {"seconds": tk, "GB_per_s": n * bb / tk / 1e9, "fraction_of_pinned_copy": frac}
    return out


def bench_decode(dev, m, block_size: int, hbm_bw: float) -> dict:
    """Paged decode attention against dense SDPA on the same tokens, and its HBM bandwidth."""
    out = {}
    for batch in (1, 8, 32, 64):
        for ctx in (1024, 4096, 16384):
            out[f"decode_b{batch}_c{ctx}"] = _decode_point(dev, m, block_size, hbm_bw, batch, ctx)
    return out


def _decode_point(dev, m, bs: int, hbm_bw: float, batch: int, ctx: int) -> dict:
    import torch
    import torch.nn.functional as F

    from gpu.kernels import decode_attention

    hkv, hq, d = m.num_kv_heads, m.num_heads, m.head_dim
    pages = -(-ctx // bs)
    kc = torch.randn((batch * pages + 1, bs, hkv, d), dtype=torch.float16, device=dev)
    vc = torch.randn_like(kc)
    tables = (torch.randperm(batch * pages, device=dev) + 1).to(torch.int32).view(batch, pages)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn((batch, hq, d), dtype=torch.float16, device=dev)
    slots = tables.long().repeat_interleave(bs, 1)[:, :ctx] * bs + torch.arange(ctx, device=dev) % bs
    kd = kc.view(-1, hkv, d)[slots].transpose(1, 2).contiguous()  # dense [B, Hkv, ctx, D]
    vd = vc.view(-1, hkv, d)[slots].transpose(1, 2).contiguous()

    def ours():
        return decode_attention(q, kc, vc, tables, lens, max_context=ctx)

    def sdpa():
        return F.scaled_dot_product_attention(q[:, :, None], kd, vd, enable_gqa=True)[:, :, 0]

    err = float((ours().float() - sdpa().float()).abs().max())
    t_ours, t_sdpa = _time(ours, dev), _time(sdpa, dev)
    nbytes = 2 * batch * ctx * hkv * d * 2
    hbm = nbytes / t_ours / hbm_bw
    notes = []
    if ctx >= 4096:
        notes.append(f"{t_ours / t_sdpa:.2f}x SDPA {_verdict(t_ours <= 1.25 * t_sdpa)}")
    if batch >= 32:
        notes.append(f"HBM {_verdict(hbm >= 0.7)}")
    print(f"decode  batch {batch:3d} ctx {ctx:6d}  {t_ours * 1e6:9.1f} us (SDPA {t_sdpa * 1e6:9.1f} us)  "
          f"{nbytes / t_ours / 1e9:7.1f} GB/s = {hbm:6.1%} of HBM  max err {err:.1e}  {'; '.join(notes)}")
    return {"seconds": t_ours, "sdpa_seconds": t_sdpa, "hbm_fraction": hbm, "max_abs_error": err}


if __name__ == "__main__":
    sys.exit(main())
