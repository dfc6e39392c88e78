"""The GPU benchmark's measurements: one function per kernel family, each timing the Triton kernel and
the torch baseline on the same data, checking they agree, and recording figures against their targets.
With `Plan.cuda_graph`, write_kv and decode attention are also timed replayed from CUDA graphs, kernel
and baseline alike (figures suffixed `_graph`): the GPU's time without Python's launch path, as vLLM
runs decode. `bench_pd_transfer` times a P/D KV transfer staged through pinned host memory against
the simulator's price of it.

Used by `benchmarks/bench_gpu.py` (the command line, the plan of points and the JSON record); torch and
the kernels are imported inside each function, so importing this module needs neither.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvsim.gpu.timing import GraphTiming
    from kvsim.sim.engine.catalog import GpuSpec, ModelSpec


@dataclass(frozen=True)
class Plan:
    """What one run measures: the model's shape (or a tiny one) and the point grids."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    window: int | None
    pairs: int
    write_tokens: tuple[int, ...]
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    sdpa_min_context: int  # the SDPA-ratio target applies from this context on
    hbm_min_batch: int  # the HBM-fraction target applies from this batch on
    seconds_per_point: float  # 0: one call, no warm-up beyond one
    pd_blocks: tuple[int, ...] = ()  # request sizes of the P/D transfer, in blocks
    cuda_graph: bool = False  # also time write_kv and decode attention (and baselines) under CUDA graphs


GRAPH_CALLS = 10  # calls captured per graph: a replay of several gives steadier per-call time for us kernels
COPY_TARGET, SWAP_TARGET, WRITE_TARGET, SDPA_TARGET, HBM_TARGET = 0.9, 0.8, 0.9, 1.25, 0.7


class Figures:
    """Named figures, each with its target (or None) and whether it meets it."""

    def __init__(self):
        self.rows: dict[str, dict] = {}

    def add(self, name: str, value: float | None, unit: str, what: str, target: float | None = None,
            compare: str = ">=", reason: str | None = None) -> str:
        """Record a figure; a value of None (not measured) has no verdict and says `reason`."""
        ok = None if target is None or value is None else bool(value >= target if compare == ">=" else value <= target)
        self.rows[name] = {"value": value, "unit": unit, "target": target,
                           "compare": None if target is None else compare, "pass": ok, "what": what}
        if value is None:
            self.rows[name]["reason"] = reason
            return f"not measured ({reason})"
        return "" if ok is None else ("meets target" if ok else "MISSES target")

    def not_measured(self) -> dict[str, str]:
        """Why each figure without a value has none."""
        return {name: row["reason"] for name, row in self.rows.items() if row["value"] is None}


class Bench:
    """Times a call: a warm-up, then as many calls as fit in `seconds` (3 to 50); one call when 0."""

    def __init__(self, dev, seconds: float):
        self.dev, self.seconds = dev, seconds

    def __call__(self, fn) -> float:
        from kvsim.gpu.timing import time_call

        if not self.seconds:
            return time_call(fn, self.dev, warmup=1, iters=1)
        first = time_call(fn, self.dev, warmup=2, iters=1)
        iters = int(min(50, max(3, self.seconds / max(first, 1e-7))))
        return time_call(fn, self.dev, warmup=0, iters=iters)

    def graph(self, fn, eager_seconds: float) -> GraphTiming:
        """`fn` replayed from a CUDA graph of GRAPH_CALLS calls, as many replays as fit in `seconds` by
        its eager time per call (an upper bound: 3 to 200); 2 calls and one replay when 0."""
        from kvsim.gpu.timing import time_graph

        if not self.seconds:
            return time_graph(fn, self.dev, calls=2, warmup=1, iters=1)
        iters = int(min(200, max(3, self.seconds / max(eager_seconds * GRAPH_CALLS, 1e-7))))
        return time_graph(fn, self.dev, calls=GRAPH_CALLS, iters=iters)


def graph_ratio(ours: GraphTiming, base: GraphTiming, ratio) -> tuple[float | None, str | None]:
    """ratio(kernel seconds, baseline seconds) under graphs, or None and why either side has no time."""
    if ours.seconds is None or base.seconds is None:
        if ours.reason == base.reason:
            return None, ours.reason
        why = [f"{side}: {t.reason}" for side, t in (("kernel", ours), ("baseline", base)) if t.seconds is None]
        return None, "; ".join(why)
    return ratio(ours.seconds, base.seconds), None


def _us(seconds: float | None) -> str:
    return "     n/a" if seconds is None else f"{seconds * 1e6:8.1f}"


def _pin() -> bool:
    import torch

    return torch.cuda.is_available()


def bench_block_ops(bench: Bench, fig: Figures, plan: Plan, bs: int, dtype, sections, pcie_bw: float) -> dict:
    """Copy and exchange against torch's index copy of the same blocks and a contiguous copy of the
    same bytes; swaps (both methods, each way) against a pinned torch copy, and the PCIe fraction."""
    import torch

    from kvsim.gpu.kernels import SWAP_METHODS, copy_blocks, exchange_blocks, swap_blocks
    from kvsim.gpu.kernels.copy_blocks import planes
    from kvsim.gpu.storage import PagedKVStorage

    dev, n = bench.dev, plan.pairs
    out: dict = {}
    st = PagedKVStorage(plan.layers, 2 * n + 1, bs, plan.kv_heads, plan.head_dim,
                        num_cpu_blocks=n if "swap" in sections else 0, dtype=dtype, device=dev)
    st.gpu.normal_()
    bb = st.block_bytes
    view = planes(st.gpu)  # [layers * 2, blocks, block elements]
    ids = torch.randperm(2 * n, device=dev) + 1
    src_ids, dst_ids = ids[:n].contiguous(), ids[n:].contiguous()
    pairs = torch.stack([src_ids, dst_ids], 1).contiguous()
    print(f"block ops: {n} pairs of {bb / 2**20:.2f} MiB blocks (all layers, K and V); GB/s count bytes read + written")

    if "block" in sections:
        buf_a = torch.empty(2 * n * bb, dtype=torch.uint8, device=dev)
        buf_b = torch.empty_like(buf_a)
        both_src, both_dst = torch.cat([src_ids, dst_ids]), torch.cat([dst_ids, src_ids])

        def torch_copy():
            view.index_copy_(1, dst_ids, view.index_select(1, src_ids))

        def torch_exchange():
            view.index_copy_(1, both_dst, view.index_select(1, both_src))

        # the kernels and torch's index copies give identical caches (checked once, bit for bit)
        st.gpu.normal_()
        saved = st.gpu.clone()
        copy_blocks(st.gpu, st.gpu, pairs)
        ours = st.gpu.clone()
        st.gpu.copy_(saved)
        torch_copy()
        same_copy = bool(torch.equal(st.gpu, ours))
        st.gpu.copy_(saved)
        exchange_blocks(st.gpu, pairs)
        ours = st.gpu.clone()
        st.gpu.copy_(saved)
        torch_exchange()
        same_exchange = bool(torch.equal(st.gpu, ours))
        del saved, ours

        for name, fn, torch_fn, payload, same in (
            ("copy_blocks", lambda: copy_blocks(st.gpu, st.gpu, pairs), torch_copy, n * bb, same_copy),
            ("exchange_blocks", lambda: exchange_blocks(st.gpu, pairs), torch_exchange, 2 * n * bb, same_exchange),
        ):
            t_contig = bench(lambda payload=payload: buf_b[:payload].copy_(buf_a[:payload]))
            t_index = bench(torch_fn)
            tk = bench(fn)
            traffic = 2 * payload
            f_index, f_contig = t_index / tk, t_contig / tk
            verdict = fig.add(f"{name}.fraction_of_index_copy", f_index, "fraction",
                              "torch index_select + index_copy_ time on the same block ids / kernel time",
                              COPY_TARGET)
            fig.add(f"{name}.fraction_of_contiguous_copy", f_contig, "fraction",
                    "contiguous device copy of the same bytes / kernel time")
            fig.add(f"{name}.matches_torch", float(same), "bool", "kernel result equals torch's bit for bit",
                    1.0)
            print(f"  {name:<16} {tk * 1e6:9.1f} us {traffic / tk / 1e9:7.1f} GB/s | torch index copy "
                  f"{t_index * 1e6:9.1f} us: {f_index:6.1%} {verdict} | contiguous copy {t_contig * 1e6:9.1f} us: "
                  f"{f_contig:6.1%} | {'same result' if same else 'RESULT DIFFERS'}")
            out[name] = {"seconds": tk, "GB_per_s": traffic / tk / 1e9, "index_copy_seconds": t_index,
                         "contiguous_copy_seconds": t_contig, "bytes_copied": payload,
                         "fraction_of_index_copy": f_index, "fraction_of_contiguous_copy": f_contig,
                         "matches_torch": same}
        del buf_a, buf_b

    if "swap" in sections:
        dev_buf = torch.empty(n * bb, dtype=torch.uint8, device=dev)
        host = torch.empty(n * bb, dtype=torch.uint8, pin_memory=_pin())
        base = {"swap_out": bench(lambda: host.copy_(dev_buf, non_blocking=True)),
                "swap_in": bench(lambda: dev_buf.copy_(host, non_blocking=True))}
        for kind, t in base.items():
            fig.add(f"{kind}.pinned_copy.fraction_of_pcie", n * bb / t / pcie_bw, "fraction",
                    "pinned torch copy GB/s / catalog pcie_bw")
            print(f"  {kind:<9} pinned torch copy {t * 1e6:9.1f} us {n * bb / t / 1e9:6.1f} GB/s = "
                  f"{n * bb / t / pcie_bw:6.1%} of PCIe ({pcie_bw / 1e9:.0f} GB/s)")
        out_pairs = torch.stack([src_ids, torch.randperm(n, device=dev)], 1).contiguous()
        for kind, a, b, p in (("swap_out", st.gpu, st.cpu, out_pairs),
                              ("swap_in", st.cpu, st.gpu, out_pairs.flip(1).contiguous())):
            for meth in SWAP_METHODS:
                pp = p if meth == "kernel" else p.cpu()
                tk = bench(lambda a=a, b=b, pp=pp, meth=meth: swap_blocks(a, b, pp, meth))
                frac, pcie = base[kind] / tk, n * bb / tk / pcie_bw
                verdict = fig.add(f"{kind}.{meth}.fraction_of_pinned_copy", frac, "fraction",
                                  "pinned torch copy time of the same bytes / swap time", SWAP_TARGET)
                fig.add(f"{kind}.{meth}.fraction_of_pcie", pcie, "fraction", "swap GB/s / catalog pcie_bw")
                print(f"  {kind:<9} {meth:<6} {n} blocks {tk * 1e6:9.1f} us {n * bb / tk / 1e9:6.1f} GB/s: "
                      f"{frac:6.1%} of pinned torch copy {verdict} | {pcie:6.1%} of PCIe")
                out[f"{kind}_{meth}"] = {"seconds": tk, "GB_per_s": n * bb / tk / 1e9, "pinned_copy_seconds": base[kind],
                                         "fraction_of_pinned_copy": frac, "fraction_of_pcie": pcie}
    return out


def bench_write_kv(bench: Bench, fig: Figures, plan: Plan, bs: int, dtype) -> dict:
    """write_kv against torch's index_copy_ (and indexed assignment) of the same tokens, same cache."""
    import torch

    from kvsim.gpu.kernels import write_kv

    dev, hq, hkv, d = bench.dev, plan.heads, plan.kv_heads, plan.head_dim
    most = max(plan.write_tokens)
    nb = 2 * -(-most // bs) + 1
    kc = torch.zeros((nb, bs, hkv, d), dtype=dtype, device=dev)
    vc = torch.zeros_like(kc)
    kflat, vflat = kc.view(-1, hkv, d), vc.view(-1, hkv, d)
    out = {}
    print(f"write_kv: one layer's cache ({nb} blocks), K/V as views of a fused qkv; tokens in shuffled blocks")
    for tokens in plan.write_tokens:
        qkv = torch.randn((tokens, hq + 2 * hkv, d), dtype=dtype, device=dev)
        key, value = qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
        blocks = torch.randperm(nb - 1, device=dev)[: -(-tokens // bs)] + 1
        pos = torch.arange(tokens, device=dev)
        slots = blocks[pos // bs] * bs + pos % bs

        def index_copy(key=key, value=value, slots=slots):
            kflat.index_copy_(0, slots, key)
            vflat.index_copy_(0, slots, value)

        def index_put(key=key, value=value, slots=slots):
            kflat[slots] = key
            vflat[slots] = value

        def ours(key=key, value=value, slots=slots):
            write_kv(key, value, kc, vc, slots)

        kc.zero_()
        vc.zero_()
        ours()
        k1, v1 = kc.clone(), vc.clone()
        kc.zero_()
        vc.zero_()
        index_copy()
        same = bool(torch.equal(kc, k1) and torch.equal(vc, v1))
        t_copy, t_put, tk = bench(index_copy), bench(index_put), bench(ours)
        nbytes = 2 * 2 * tokens * hkv * d * kc.element_size()  # K and V, read and written
        f_copy, f_put = t_copy / tk, t_put / tk
        name = f"write_kv_t{tokens}"
        verdict = fig.add(f"{name}.fraction_of_index_copy", f_copy, "fraction",
                          "torch index_copy_ (K then V) time / write_kv time (target set by this script)",
                          WRITE_TARGET)
        fig.add(f"{name}.fraction_of_index_put", f_put, "fraction", "torch indexed assignment time / write_kv time")
        fig.add(f"{name}.matches_torch", float(same), "bool", "cache equals index_copy_'s bit for bit", 1.0)
        print(f"  {tokens:6d} tokens {tk * 1e6:9.1f} us {nbytes / tk / 1e9:7.1f} GB/s | index_copy_ "
              f"{t_copy * 1e6:9.1f} us: {f_copy:6.1%} {verdict} | indexed assignment {t_put * 1e6:9.1f} us: "
              f"{f_put:6.1%} | {'same result' if same else 'RESULT DIFFERS'}")
        out[name] = {"seconds": tk, "GB_per_s": nbytes / tk / 1e9, "index_copy_seconds": t_copy,
                     "index_put_seconds": t_put, "fraction_of_index_copy": f_copy, "fraction_of_index_put": f_put,
                     "matches_torch": same}
        if plan.cuda_graph:
            g_ours, g_copy = bench.graph(ours, tk), bench.graph(index_copy, t_copy)
            f_graph, why = graph_ratio(g_ours, g_copy, lambda t_ours, t_base: t_base / t_ours)
            verdict = fig.add(f"{name}.fraction_of_index_copy_graph", f_graph, "fraction",
                              "the same, both replayed from CUDA graphs (no host launch path)", WRITE_TARGET,
                              reason=why)
            shown = "" if f_graph is None else f"{f_graph:6.1%} "
            print(f"  {'':6s} graphs {_us(g_ours.seconds)} us | index_copy_ {_us(g_copy.seconds)} us: {shown}{verdict}")
            out[name]["graph"] = {"seconds": g_ours.seconds, "index_copy_seconds": g_copy.seconds,
                                  "fraction_of_index_copy": f_graph, "reason": why}
    return out


def bench_decode(bench: Bench, fig: Figures, plan: Plan, bs: int, dtype, hbm_bw: float, block_n: int) -> dict:
    """Paged decode attention against dense SDPA on the same tokens, and its HBM bandwidth."""
    out = {}
    print(f"decode attention (block_n {block_n}): paged kernel vs SDPA over the same tokens, dense; "
          f"HBM fraction of K+V bytes read")
    for batch in plan.batches:
        for ctx in plan.contexts:
            out[f"decode_b{batch}_c{ctx}"] = _decode_point(bench, fig, plan, bs, dtype, hbm_bw, batch, ctx, block_n)
    return out


def _decode_inputs(bench: Bench, plan: Plan, bs: int, dtype, batch: int, ctx: int, kc, vc) -> tuple:
    """A decode of `batch` sequences of `ctx` tokens over the paged caches `kc`, `vc` ([pages + 1, bs,
    kv heads, dim]): block tables over distinct random pages (page 0 unused), context lengths, queries,
    how many tokens attention reads (the window's), and those tokens' K and V laid out densely
    ([batch, kv heads, tokens, dim]) for SDPA."""
    import torch

    dev, hkv, d, window = bench.dev, plan.kv_heads, plan.head_dim, plan.window
    pages = -(-ctx // bs)
    tables = (torch.randperm(batch * pages, device=dev) + 1).to(torch.int32).view(batch, pages)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn((batch, plan.heads, d), dtype=dtype, device=dev)
    seen = min(ctx, window) if window else ctx  # SDPA gets the tokens the window keeps
    pos = torch.arange(ctx - seen, ctx, device=dev)
    slots = tables.long()[:, pos // bs] * bs + pos % bs
    kd = kc.view(-1, hkv, d)[slots].transpose(1, 2).contiguous()
    vd = vc.view(-1, hkv, d)[slots].transpose(1, 2).contiguous()
    return tables, lens, q, seen, kd, vd


def _decode_point(bench: Bench, fig: Figures, plan: Plan, bs: int, dtype, hbm_bw: float, batch: int, ctx: int,
                  block_n: int) -> dict:
    import torch
    import torch.nn.functional as F

    from kvsim.gpu.kernels import decode_attention

    window = plan.window
    kc = torch.randn((batch * -(-ctx // bs) + 1, bs, plan.kv_heads, plan.head_dim), dtype=dtype, device=bench.dev)
    vc = torch.randn_like(kc)
    tables, lens, q, seen, kd, vd = _decode_inputs(bench, plan, bs, dtype, batch, ctx, kc, vc)
    hkv, d = plan.kv_heads, plan.head_dim

    def ours():
        return decode_attention(q, kc, vc, tables, lens, sliding_window=window, max_context=ctx, block_n=block_n)

    def sdpa():
        return F.scaled_dot_product_attention(q[:, :, None], kd, vd, enable_gqa=True)[:, :, 0]

    err = float((ours().float() - sdpa().float()).abs().max())
    t_sdpa, t_ours = bench(sdpa), bench(ours)
    nbytes = 2 * batch * seen * hkv * d * kc.element_size()
    hbm, hbm_sdpa, ratio = nbytes / t_ours / hbm_bw, nbytes / t_sdpa / hbm_bw, t_ours / t_sdpa
    name = f"decode_b{batch}_c{ctx}"
    v_ratio = fig.add(f"{name}.sdpa_ratio", ratio, "x", "paged kernel time / dense SDPA time",
                      SDPA_TARGET if ctx >= plan.sdpa_min_context else None, "<=")
    v_hbm = fig.add(f"{name}.hbm_fraction", hbm, "fraction", "K+V bytes read / kernel time / datasheet HBM",
                    HBM_TARGET if batch >= plan.hbm_min_batch else None)
    fig.add(f"{name}.sdpa_hbm_fraction", hbm_sdpa, "fraction", "the same for SDPA")
    print(f"  batch {batch:3d} ctx {ctx:6d}  {t_ours * 1e6:9.1f} us ({ratio:4.2f}x SDPA {t_sdpa * 1e6:9.1f} us) "
          f"{v_ratio:<13} | {nbytes / t_ours / 1e9:7.1f} GB/s = {hbm:6.1%} of HBM {v_hbm:<13} "
          f"(SDPA {hbm_sdpa:6.1%}) | max |diff| {err:.1e}")
    point = {"seconds": t_ours, "sdpa_seconds": t_sdpa, "sdpa_ratio": ratio, "hbm_fraction": hbm,
             "sdpa_hbm_fraction": hbm_sdpa, "tokens_read": seen, "max_abs_diff_vs_sdpa": err}
    if plan.cuda_graph:
        g_ours, g_sdpa = bench.graph(ours, t_ours), bench.graph(sdpa, t_sdpa)
        ratio_g, why = graph_ratio(g_ours, g_sdpa, lambda t_ours, t_base: t_ours / t_base)
        hbm_g = None if g_ours.seconds is None else nbytes / g_ours.seconds / hbm_bw
        # the same targets as eager: under graphs batches 1-8 at >= sdpa_min_context lose their excuse
        v_ratio = fig.add(f"{name}.sdpa_ratio_graph", ratio_g, "x", "the same, both replayed from CUDA graphs",
                          SDPA_TARGET if ctx >= plan.sdpa_min_context else None, "<=", reason=why)
        v_hbm = fig.add(f"{name}.hbm_fraction_graph", hbm_g, "fraction", "the same, the kernel replayed from a CUDA graph",
                        HBM_TARGET if batch >= plan.hbm_min_batch else None, reason=g_ours.reason)
        shown = "" if ratio_g is None else f"{ratio_g:4.2f}x SDPA "
        print(f"  {'':21s}graphs {_us(g_ours.seconds)} us ({shown}{_us(g_sdpa.seconds)} us) {v_ratio:<13}"
              + ("" if hbm_g is None else f" | {hbm_g:6.1%} of HBM {v_hbm}"))
        point["graph"] = {"seconds": g_ours.seconds, "sdpa_seconds": g_sdpa.seconds, "sdpa_ratio": ratio_g,
                          "hbm_fraction": hbm_g, "reason": why}
    return point


FP8_SCALES = (0.5, 2.0)  # (K, V) scales of the FP8 points: powers of two, as the replay's


def bench_decode_fp8(bench: Bench, fig: Figures, plan: Plan, bs: int, dtype, hbm_bw: float, block_n: int,
                     fp8_dtype) -> dict:
    """Paged decode attention on an FP8 cache (vLLM's `--kv-cache-dtype fp8`: K / k_scale and V / v_scale in
    one byte) against the same kernel on the 16-bit cache of the same values, point by point: the time
    ratio (half the bytes: about 0.5 where decode is bandwidth-bound, about 1 where it is launch-bound)
    and the HBM fraction of the bytes it reads; checked against SDPA over the FP8 values dequantized."""
    out = {}
    print(f"decode attention on an FP8 cache ({str(fp8_dtype).removeprefix('torch.')}, K scale {FP8_SCALES[0]:g}, "
          f"V scale {FP8_SCALES[1]:g}) against the same kernel on {str(dtype).removeprefix('torch.')}; "
          f"HBM fraction of the FP8 K+V bytes read")
    for batch in plan.batches:
        for ctx in plan.contexts:
            out[f"decode_fp8_b{batch}_c{ctx}"] = _decode_fp8_point(bench, fig, plan, bs, dtype, hbm_bw, batch, ctx,
                                                                   block_n, fp8_dtype)
    return out


def _decode_fp8_point(bench: Bench, fig: Figures, plan: Plan, bs: int, dtype, hbm_bw: float, batch: int, ctx: int,
                      block_n: int, fp8_dtype) -> dict:
    import torch
    import torch.nn.functional as F

    from kvsim.gpu.kernels import decode_attention

    ks, vs = FP8_SCALES
    shape = (batch * -(-ctx // bs) + 1, bs, plan.kv_heads, plan.head_dim)
    k8 = (torch.randn(shape, dtype=dtype, device=bench.dev) / ks).to(fp8_dtype)
    v8 = (torch.randn_like(k8, dtype=dtype) / vs).to(fp8_dtype)
    kc, vc = k8.to(dtype) * ks, v8.to(dtype) * vs  # the same values, 16-bit (exact: scales are powers of two)
    tables, lens, q, seen, kd, vd = _decode_inputs(bench, plan, bs, dtype, batch, ctx, kc, vc)
    hkv, d = plan.kv_heads, plan.head_dim
    kw = {"sliding_window": plan.window, "max_context": ctx, "block_n": block_n}

    def fp8():
        return decode_attention(q, k8, v8, tables, lens, kv_scales=FP8_SCALES, **kw)

    def half():
        return decode_attention(q, kc, vc, tables, lens, **kw)

    ref = F.scaled_dot_product_attention(q[:, :, None], kd, vd, enable_gqa=True)[:, :, 0].float()
    err = float((fp8().float() - ref).abs().max())
    err_half = float((half().float() - ref).abs().max())
    t_half, t_fp8 = bench(half), bench(fp8)
    nbytes = 2 * batch * seen * hkv * d * k8.element_size()
    name = f"decode_fp8_b{batch}_c{ctx}"
    ratio, hbm = t_fp8 / t_half, nbytes / t_fp8 / hbm_bw
    fig.add(f"{name}.time_vs_16bit", ratio, "x", "the paged kernel's time on the FP8 cache / on the 16-bit cache")
    fig.add(f"{name}.hbm_fraction", hbm, "fraction", "FP8 K+V bytes read / kernel time / datasheet HBM")
    print(f"  batch {batch:3d} ctx {ctx:6d}  {t_fp8 * 1e6:9.1f} us ({ratio:4.2f}x of {t_half * 1e6:9.1f} us 16-bit) | "
          f"{nbytes / t_fp8 / 1e9:7.1f} GB/s = {hbm:6.1%} of HBM | max |diff| vs SDPA {err:.1e} (16-bit {err_half:.1e})")
    point = {"seconds": t_fp8, "seconds_16bit": t_half, "time_vs_16bit": ratio, "hbm_fraction": hbm,
             "tokens_read": seen, "max_abs_diff_vs_sdpa": err, "max_abs_diff_vs_sdpa_16bit": err_half}
    if plan.cuda_graph:
        g8, g16 = bench.graph(fp8, t_fp8), bench.graph(half, t_half)
        ratio_g, why = graph_ratio(g8, g16, lambda a, b: a / b)
        hbm_g = None if g8.seconds is None else nbytes / g8.seconds / hbm_bw
        fig.add(f"{name}.time_vs_16bit_graph", ratio_g, "x", "the same, both replayed from CUDA graphs", reason=why)
        fig.add(f"{name}.hbm_fraction_graph", hbm_g, "fraction", "the same, replayed from a CUDA graph",
                reason=g8.reason)
        shown = "n/a" if ratio_g is None else f"{ratio_g:4.2f}x"
        print(f"  {'':21s}graphs {_us(g8.seconds)} us ({shown} of {_us(g16.seconds)} us)"
              + ("" if hbm_g is None else f" | {hbm_g:6.1%} of HBM"))
        point["graph"] = {"seconds": g8.seconds, "seconds_16bit": g16.seconds, "time_vs_16bit": ratio_g,
                          "hbm_fraction": hbm_g, "reason": why}
    return point


def bench_pd_transfer(bench: Bench, fig: Figures, plan: Plan, bs: int, dtype, model: ModelSpec, gpu: GpuSpec) -> dict:
    """A P/D KV transfer staged through the host: a request's blocks, scattered in a prefill side's
    storage, gathered into pinned host memory and scattered into a decode side's storage (swap_blocks'
    kernel each hop; one device stands in for both GPUs). Timed against the simulator's prices: its P/D
    read (`sim.engine.nixl.KVTransfer.seconds` at SimConfig's NIXL defaults) and its two PCIe swaps
    (`CostModel.op_cost_s` swap_out + swap_in, from the catalog's pcie_bw); checks the blocks arrive intact."""
    import torch

    from kvsim.gpu.kernels import swap_blocks
    from kvsim.gpu.storage import PagedKVStorage
    from kvsim.sim.engine.config import SimConfig
    from kvsim.sim.engine.cost_model import CostModel
    from kvsim.sim.engine.nixl import BlockBytes, KVTransfer

    dev, most = bench.dev, max(plan.pd_blocks)
    nb = 2 * most + 1
    prefill = PagedKVStorage(plan.layers, nb, bs, plan.kv_heads, plan.head_dim, num_cpu_blocks=most, dtype=dtype,
                             device=dev)
    decode = PagedKVStorage(plan.layers, nb, bs, plan.kv_heads, plan.head_dim, dtype=dtype, device=dev)
    prefill.gpu.normal_()
    bb = prefill.block_bytes
    # the simulator's model at the plan's geometry (the model's own outside --quick)
    shape = replace(model, num_layers=plan.layers, num_heads=plan.heads, num_kv_heads=plan.kv_heads,
                    head_dim=plan.head_dim)
    cost = CostModel(shape, gpu, 1, bs, kv_dtype_bytes=prefill.gpu.element_size())
    if cost.kv_bytes_per_block != bb:
        raise ValueError(f"bench_pd_transfer: the simulator prices a {model.name} block at {cost.kv_bytes_per_block} "
                         f"bytes, the storage's holds {bb}")
    cfg = SimConfig()
    nixl = KVTransfer(BlockBytes.of(cost), cfg.kv_transfer_gbps, cfg.kv_transfer_latency)
    gen = torch.Generator().manual_seed(0)
    out = {}
    print(f"P/D transfer: a request's blocks ({bb / 2**20:.2f} MiB each, all layers, K and V) at random ids, prefill "
          f"storage -> pinned host -> decode storage (swap_blocks kernel), one device for both | simulator: NIXL "
          f"read at {cfg.kv_transfer_gbps:g} GB/s + {cfg.kv_transfer_latency * 1e6:g} us; PCIe swap out + in at "
          f"{gpu.pcie_bw / 1e9:g} GB/s each")
    for n in plan.pd_blocks:
        src = torch.randperm(nb - 1, generator=gen)[:n] + 1
        dst = torch.randperm(nb - 1, generator=gen)[:n] + 1
        staged = torch.arange(n)
        to_host = torch.stack([src, staged], 1).to(dev)
        from_host = torch.stack([staged, dst], 1).to(dev)

        def d2h(to_host=to_host):
            swap_blocks(prefill.gpu, prefill.cpu, to_host, "kernel")

        def h2d(from_host=from_host):
            swap_blocks(prefill.cpu, decode.gpu, from_host, "kernel")

        def transfer():
            d2h()
            h2d()

        prefill.cpu.zero_()
        decode.gpu.zero_()
        transfer()
        src_d, dst_d = src.to(dev), dst.to(dev)
        intact = all(bool(torch.equal(decode.gpu[layer][:, dst_d], prefill.gpu[layer][:, src_d]))
                     for layer in range(plan.layers))
        t_total, t_d2h, t_h2d = bench(transfer), bench(d2h), bench(h2d)
        nbytes = n * bb
        t_nixl = nixl.seconds(n)
        t_pcie = n * (cost.op_cost_s["swap_out"] + cost.op_cost_s["swap_in"])
        name = f"pd_blocks{n}"
        fig.add(f"{name}.sim_ratio", t_total / t_nixl, "x",
                "measured staged transfer time / the simulator's P/D read (KVTransfer.seconds, SimConfig defaults)")
        fig.add(f"{name}.pcie_ratio", t_total / t_pcie, "x",
                "measured staged transfer time / the simulator's swap_out + swap_in of the same blocks (catalog pcie_bw)")
        fig.add(f"{name}.matches_source", float(intact), "bool", "decode storage's blocks equal the prefill side's",
                1.0)
        print(f"  {n:5d} blocks {nbytes / 2**20:9.1f} MiB {t_total * 1e3:9.3f} ms {nbytes / t_total / 1e9:6.1f} GB/s "
              f"(to host {nbytes / t_d2h / 1e9:6.1f}, from host {nbytes / t_h2d / 1e9:6.1f}) | simulator: NIXL read "
              f"{t_nixl * 1e3:9.3f} ms ({t_total / t_nixl:5.2f}x), PCIe out + in {t_pcie * 1e3:9.3f} ms "
              f"({t_total / t_pcie:5.2f}x) | {'intact' if intact else 'DATA DIFFERS'}")
        out[name] = {"blocks": n, "bytes": nbytes, "seconds": t_total, "GB_per_s": nbytes / t_total / 1e9,
                     "to_host_seconds": t_d2h, "from_host_seconds": t_h2d,
                     "sim_nixl_seconds": t_nixl, "sim_ratio": t_total / t_nixl,
                     "sim_pcie_seconds": t_pcie, "pcie_ratio": t_total / t_pcie, "matches_source": intact}
    return out
