"""The synthetic forward step: Batch's cost-model arguments, the step against a float64
plain-torch forward of the same weights (mask alignment included), the mixture of experts
against a per-token loop, the grids and their rows."""

import json
import math
from dataclasses import replace

import pytest
import torch
from gpu_env import DEVICE

from kvsim.gpu import forward_step
from kvsim.gpu.forward_step import (
    TINY,
    TINY_MOE,
    Batch,
    ForwardStep,
    decodes,
    default_grid,
    holdout_grid,
    kv_capacity_tokens,
    main,
    quick_grid,
    route,
    run_grid,
)
from kvsim.sim.engine.catalog import get_gpu, get_model
from kvsim.sim.engine.cost_model import CostModel
from kvsim.sim.engine.hf_config import model_spec

MIXED = Batch((5, 17), ((7, 5), (0, 8)))  # two decodes, a chunk after 7 cached tokens, a fresh chunk


def test_batch_gives_step_time_arguments():
    assert (MIXED.prefill_tokens, MIXED.decode_tokens, MIXED.context_tokens, MIXED.num_seqs) == (13, 2, 42, 4)
    assert MIXED.seqs() == [(4, 1), (16, 1), (7, 5), (0, 8)]
    assert MIXED.describe() == "dec 1@5 + dec 1@17 + pre 5@7 + pre 8@0"
    b = Batch(decodes(32, 2048), ((0, 2048),))
    assert (b.prefill_tokens, b.decode_tokens, b.context_tokens, b.num_seqs) == (2048, 32, 67584, 33)
    assert b.describe() == "dec 32@2048 + pre 2048@0"
    assert Batch(tuple(range(1, 65))).describe() == "dec 64@1..64"
    assert Batch(prefill=((0, 512),) * 4).describe() == "pre 4x512@0"
    cm = CostModel(get_model("llama-3-8b"), get_gpu("h100-sxm"))
    assert cm.step_time(b.prefill_tokens, b.decode_tokens, b.context_tokens, b.num_seqs) == \
        cm.step_time(2048, 32, 32 * 2048 + 2048, 33)
    with pytest.raises(ValueError, match="prior >= 0"):
        Batch(prefill=((0, 0),))
    with pytest.raises(ValueError, match="decode_ctx"):
        Batch((0,))


def test_shapes_are_one_tp_rank():
    step = ForwardStep(TINY, tp=2, device=DEVICE, dtype=torch.float32)
    assert (step.heads, step.kv_heads) == (2, 1)
    assert tuple(step.w_qkv.shape) == ((2 + 2) * 16, 64)
    assert tuple(step.w_o.shape) == (64, 32)
    assert tuple(step.w_gate_up.shape) == (96, 64) and tuple(step.w_down.shape) == (64, 48)
    assert tuple(step.lm_head.shape) == (64, 64)


def test_prepare_lays_out_cache_tables_and_slots():
    step = ForwardStep(TINY, device=DEVICE, dtype=torch.float32, block_size=4)
    s = step.prepare(MIXED)
    blocks = [b.tolist() for b in s.seq_blocks]
    assert [len(b) for b in blocks] == [2, 5, 3, 2]  # ceil(len / 4) for lengths 5, 17, 12, 8
    assert sorted(sum(blocks, [])) == list(range(12)) and s.key_cache.shape == (12, 4, 2, 16)
    assert s.decode_tables.tolist() == [blocks[0] + [0, 0, 0], blocks[1]]
    assert s.decode_lens.tolist() == [5, 17]
    # decode tokens at positions 4 and 16; the chunks' at 7..11 and 0..7
    pos = [4, 16, *range(7, 12), *range(8)]
    owner = [0, 1] + [2] * 5 + [3] * 8
    assert s.slot_mapping.tolist() == [blocks[i][p // 4] * 4 + p % 4 for i, p in zip(owner, pos, strict=True)]
    assert s.sample_rows.tolist() == [0, 1, 6, 14]
    assert torch.allclose(s.cos[:, 0, 0].double().cpu(), torch.tensor(pos).double().cos())


def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()


def _rope(x, pos):
    half = x.shape[-1] // 2
    ang = pos.double()[:, None, None] * 500_000.0 ** (-torch.arange(half, dtype=torch.float64) / half)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()), -1)


def _ref_attention(q, keys, values, seqs, top_left=False):
    """q [T, H, D] float64; keys/values: each sequence's [p + n, KVH, D]. Query r of a chunk
    after p cached tokens sees keys 0..p + r (or, wrongly aligned, 0..r)."""
    outs, start = [], 0
    for (p, n), k, v in zip(seqs, keys, values, strict=True):
        group = q.shape[1] // k.shape[1]
        k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[start:start + n], k) / math.sqrt(q.shape[-1])
        limit = torch.arange(n)[:, None] + (0 if top_left else p)
        scores = scores.masked_fill(torch.arange(p + n)[None, :] > limit, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).flatten(1))
        start += n
    return torch.cat(outs)


def _context(step, s, cache, length_of):
    """Each sequence's first length_of(p, n) cached K or V, float64 on the CPU."""
    flat = cache.double().cpu().flatten(0, 1)
    bs = step.block_size
    out = []
    for (p, n), blocks in zip(s.batch.seqs(), s.seq_blocks, strict=True):
        slots = (blocks.cpu()[:, None] * bs + torch.arange(bs)).flatten()
        out.append(flat[slots[: length_of(p, n)]])
    return out


def test_attention_matches_reference_with_bottom_right_mask():
    step = ForwardStep(TINY, device=DEVICE, dtype=torch.float32, block_size=4)
    s = step.prepare(MIXED)
    q = torch.randn((15, 4, 16), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    out = step.attention(q, s).double().cpu()
    keys = _context(step, s, s.key_cache, lambda p, n: p + n)
    values = _context(step, s, s.value_cache, lambda p, n: p + n)
    ref = _ref_attention(q.double().cpu(), keys, values, MIXED.seqs())
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    wrong = _ref_attention(q.double().cpu(), keys, values, MIXED.seqs(), top_left=True)
    assert (out[2:7] - wrong[2:7]).abs().max() > 0.1  # the chunk after 7 cached tokens tells them apart
    torch.testing.assert_close(out[7:], wrong[7:], atol=1e-5, rtol=1e-5)  # no prior context: same mask


def _mlp(h, gate_up, down):
    """A gated MLP of h [in] or [tokens, in] by [in, 2 * inter] and [inter, out] matrices."""
    gate, up = (h @ gate_up).chunk(2, -1)
    return (torch.nn.functional.silu(gate) * up) @ down


def _ref_moe(h, w, routing):
    """The experts by a loop over tokens: each token's k experts' outputs, weighted, summed; plus
    the shared expert. h and the weights `w` (by attribute name) in one dtype, on the CPU."""
    out = torch.zeros_like(h)
    for t in range(h.shape[0]):
        for e, weight in zip(routing.token_experts[t].tolist(), routing.token_weights[t].tolist(), strict=True):
            out[t] += weight * _mlp(h[t], w["w_experts_gate_up"][e], w["w_experts_down"][e])
    if "w_shared_gate_up" in w:
        out += _mlp(h, w["w_shared_gate_up"].T, w["w_shared_down"].T)
    return out


def _ref_forward(step, s, prior_k, prior_v):
    """The whole step in float64 with plain torch, reading only the prior context from the cache."""
    w = {k: v.double().cpu() for k, v in vars(step).items() if isinstance(v, torch.Tensor)}
    heads, kvh, d = step.heads, step.kv_heads, step.head_dim
    seqs = s.batch.seqs()
    pos = torch.cat([torch.arange(p, p + n) for p, n in seqs])
    x = w["lm_head"][s.token_ids.cpu()]
    for i in range(step.model.num_layers):
        qkv = _rms(x, w["norm_attn"]) @ w["w_qkv"].T
        q, k = qkv[:, : heads * d].view(-1, heads, d), qkv[:, heads * d:(heads + kvh) * d].view(-1, kvh, d)
        if "qk_norm" in w:
            q, k = _rms(q, w["qk_norm"][:heads]), _rms(k, w["qk_norm"][heads:])
        q, k = _rope(q, pos), _rope(k, pos)
        v = qkv[:, (heads + kvh) * d:].view(-1, kvh, d)
        bounds = torch.cumsum(torch.tensor([0] + [n for _, n in seqs]), 0).tolist()
        keys = [torch.cat((pk, k[a:b])) for pk, a, b in zip(prior_k, bounds[:-1], bounds[1:], strict=True)]
        values = [torch.cat((pv, v[a:b])) for pv, a, b in zip(prior_v, bounds[:-1], bounds[1:], strict=True)]
        x = x + _ref_attention(q, keys, values, seqs) @ w["w_o"].T
        h = _rms(x, w["norm_mlp"])
        x = x + (_ref_moe(h, w, s.routing) if i < step.model.moe_layers else _mlp(h, w["w_gate_up"].T, w["w_down"].T))
    rows = torch.tensor(bounds[1:]) - 1
    return _rms(x[rows], w["norm_final"]) @ w["lm_head"].T


@pytest.mark.parametrize("model", [TINY, TINY_MOE], ids=["dense", "moe"])
def test_forward_matches_float64_reference(model):
    step = ForwardStep(model, device=DEVICE, dtype=torch.float32, block_size=4)
    s = step.prepare(MIXED)
    prior_k = _context(step, s, s.key_cache, lambda p, n: p)
    prior_v = _context(step, s, s.value_cache, lambda p, n: p)
    logits = step.forward(s)
    assert logits.shape == (4, 128)
    ref = _ref_forward(step, s, prior_k, prior_v)
    torch.testing.assert_close(logits.double().cpu(), ref, atol=1e-3, rtol=1e-3)


def test_dense_step_draws_what_it_drew_before_experts():
    """A dense model's weights and inputs come from the same draws as before MoE support (the
    experts, q/k norms and routing are drawn after them): golden values of seed 0."""
    step = ForwardStep(TINY, device="cpu", dtype=torch.float32)
    s = step.prepare(MIXED)
    assert s.routing is None and not hasattr(step, "w_router") and step.qk_norm is None
    assert (round(step.w_qkv[0, 0].item(), 6), round(step.lm_head[-1, -1].item(), 6)) == (-0.14073, -0.10429)
    assert s.token_ids.tolist()[:4] == [67, 123, 67, 103]


def test_routing_picks_k_distinct_experts_and_lays_out_rows():
    r = route(40, 16, 4, torch.Generator().manual_seed(3))
    picks = r.token_experts
    assert picks.shape == (40, 4) and all(len(set(row)) == 4 for row in picks.tolist())
    assert r.experts == len(picks.unique()) == 16 and picks.max() == 15  # 40 tokens touch all 16
    counts = torch.bincount(picks.flatten(), minlength=r.experts)
    assert r.capacity == counts.max() and r.slots.shape == (16 * r.capacity,)
    torch.testing.assert_close(r.token_weights.sum(-1), torch.ones(40))
    # every (token, expert) pair owns one row of its expert's block, with its weight; padding weighs 0
    for e in range(r.experts):
        block, weights = r.slots[e * r.capacity:(e + 1) * r.capacity], r.slot_weights[e * r.capacity:(e + 1) * r.capacity, 0]
        tokens = [t for t in range(40) if e in picks[t].tolist()]
        assert block[: len(tokens)].tolist() == tokens and block[len(tokens):].eq(0).all()
        assert weights[: len(tokens)].tolist() == [r.token_weights[t][picks[t].tolist().index(e)].item() for t in tokens]
        assert weights[len(tokens):].eq(0).all()
    few = route(3, 128, 8, torch.Generator().manual_seed(0))
    assert (few.experts, few.capacity) == (21, 2)  # 24 picks: three experts picked by two tokens
    # the grouped layout: the same (token, weight) rows, sorted by expert, unpadded; offsets end each expert's
    assert r.offsets.dtype == torch.int32 and r.offsets.tolist() == torch.cumsum(counts, 0).tolist()
    assert r.offsets[-1] == len(r.sorted_slots) == 40 * 4
    for e in range(r.experts):
        lo, hi = (r.offsets[e - 1].item() if e else 0), r.offsets[e].item()
        block = r.slots[e * r.capacity:e * r.capacity + hi - lo]
        assert r.sorted_slots[lo:hi].tolist() == block.tolist()
        torch.testing.assert_close(r.sorted_weights[lo:hi], r.slot_weights[e * r.capacity:e * r.capacity + hi - lo],
                                   atol=0, rtol=0)


def test_routing_touches_the_cost_models_expected_experts():
    """Over many draws the touched count averages CostModel.experts_touched (qwen3-30b-a3b: 128, 8)."""
    cm = CostModel(model_spec("qwen3-30b-a3b"), get_gpu("h100-sxm"))
    gen = torch.Generator().manual_seed(0)
    for tokens in (1, 4, 16, 64):
        mean = sum(route(tokens, 128, 8, gen).experts for _ in range(200)) / 200
        assert mean == pytest.approx(cm.experts_touched(tokens), rel=0.02), tokens
    assert route(1, 128, 8, gen).experts == 8


def test_moe_mlp_matches_per_token_reference():
    step = ForwardStep(TINY_MOE, device=DEVICE, dtype=torch.float32)
    s = step.prepare(MIXED)
    h = torch.randn((15, 64), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    out = step.moe_mlp(h, s.routing).cpu()
    w = {k: v.cpu() for k, v in vars(step).items() if isinstance(v, torch.Tensor)}
    torch.testing.assert_close(out, _ref_moe(h.cpu(), w, s.routing), atol=1e-5, rtol=1e-5)
    assert s.routing.token_experts.shape == (15, 2) and s.routing.experts == len(s.routing.token_experts.unique())


def test_grouped_moe_kernel_matches_the_padded_one():
    """moe_kernel "grouped" (torch._grouped_mm over the unpadded rows, bfloat16) computes what the
    padded bmm does, to bfloat16's rounding, and the per-token reference."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip(f"torch {torch.__version__} has no _grouped_mm")
    outs = {}
    for kernel in ("bmm", "grouped"):
        step = ForwardStep(TINY_MOE, device=DEVICE, moe_kernel=kernel)
        s = step.prepare(MIXED)
        h = torch.randn((15, 64), generator=torch.Generator().manual_seed(2)).to(DEVICE, torch.bfloat16)
        outs[kernel] = step.moe_mlp(h, s.routing).float().cpu()
    w = {k: v.cpu().float() for k, v in vars(step).items() if isinstance(v, torch.Tensor)}
    ref = _ref_moe(h.cpu().float(), w, s.routing)
    torch.testing.assert_close(outs["grouped"], outs["bmm"], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(outs["grouped"], ref, atol=3e-2, rtol=3e-2)
    with pytest.raises(ValueError, match="moe_kernel 'grouped' needs bfloat16"):
        ForwardStep(TINY_MOE, device=DEVICE, dtype=torch.float32, moe_kernel="grouped")
    with pytest.raises(ValueError, match="moe_kernel 'fused'"):
        ForwardStep(TINY_MOE, device=DEVICE, moe_kernel="fused")


def test_moe_shapes_are_one_tp_rank():
    step = ForwardStep(TINY_MOE, tp=2, device=DEVICE, dtype=torch.float32)
    assert tuple(step.w_router.shape) == (8, 64)
    assert tuple(step.w_experts_gate_up.shape) == (8, 64, 32) and tuple(step.w_experts_down.shape) == (8, 16, 64)
    assert tuple(step.w_shared_gate_up.shape) == (24, 64) and tuple(step.w_shared_down.shape) == (64, 12)
    assert tuple(step.w_gate_up.shape) == (96, 64) and tuple(step.qk_norm.shape) == (3, 16)
    all_moe = ForwardStep(replace(TINY_MOE, moe_layers=2, shared_expert_intermediate_size=0), device=DEVICE)
    assert all_moe.w_gate_up is None and all_moe.w_shared_gate_up is None


def test_refuses_what_it_cannot_build():
    with pytest.raises(ValueError, match="cannot build deepseek-v3: it has multi-head latent attention "
                                         r"\(kv_lora_rank 512\); quantized weights"):
        ForwardStep(model_spec("deepseek-v3"))
    with pytest.raises(ValueError, match="cannot build qwen3-next-80b-a3b: it has linear-attention"):
        ForwardStep(model_spec("qwen3-next-80b-a3b"))


def test_default_grid_fits_a_real_server():
    assert kv_capacity_tokens(get_model("llama-3-8b")) == 448308
    assert kv_capacity_tokens(get_model("llama-3-70b"), 2) == 26046
    grid8, grid70 = default_grid("llama-3-8b"), default_grid("llama-3-70b", tp=2)
    assert (len(grid8), len(grid70)) == (41, 23)
    assert all(b.context_tokens <= 448308 for b in grid8)
    assert Batch(decodes(256, 1024)) in grid8 and Batch(decodes(128, 4096)) not in grid8
    assert Batch(decodes(16, 16384)) in grid8 and Batch(decodes(32, 16384)) not in grid8
    assert {b.prefill for b in grid8 if not b.decode_ctx} >= {((p, n),) for n in (512, 2048, 8192) for p in (0, 4096)}
    assert Batch(decodes(32, 2048), ((0, 2048),)) in grid8
    assert Batch(decodes(1, 16384)) in grid70 and Batch(decodes(4, 16384)) not in grid70


def test_holdout_grid_is_new_points_that_fit():
    grid8, grid70, grid_moe = holdout_grid("llama-3-8b"), holdout_grid("llama-3-70b", 2), holdout_grid("qwen3-30b-a3b")
    assert (len(grid8), len(grid70), len(grid_moe)) == (30, 20, 26)
    assert not set(grid8) & set(default_grid("llama-3-8b")) and not set(grid70) & set(default_grid("llama-3-70b", 2))
    assert len(set(grid8)) == 30 and set(grid70) < set(grid8) and set(grid_moe) < set(grid8)
    assert kv_capacity_tokens(model_spec("qwen3-30b-a3b")) == 139943
    assert max(b.context_tokens for b in grid8) <= 448308 and max(b.context_tokens for b in grid70) <= 26046
    assert max(b.context_tokens for b in grid_moe) <= 139943
    assert Batch(decodes(192, 1536)) in grid8 and Batch(decodes(192, 1536)) not in grid_moe  # 294912 tokens
    assert Batch(decodes(2, 12288)) in grid70 and Batch(decodes(8, 12288)) not in grid70  # 98304 > 26046
    assert {b.prefill for b in grid8 if not b.decode_ctx} >= {((0, 256),), ((8192, 3072),), ((1536, 6144),)}


COLUMNS = {
    "model", "tp", "dtype", "device", "prefill_tokens", "decode_tokens", "context_tokens", "num_seqs",
    "measured_s", "cuda_graph", "iters", "batch", "decode_ctx", "prefill",
}


def test_run_grid_rows(tmp_path):
    lines = []
    rows = run_grid(TINY, 1, DEVICE, torch.bfloat16, quick_grid()[3:], progress=lines.append,
                    warmup=0, iters=1)
    assert len(rows) == 1 and set(rows[0]) == COLUMNS and len(lines) == 1
    row = rows[0]
    assert (row["model"], row["tp"], row["dtype"], row["batch"]) == ("tiny", 1, "bfloat16", "dec 1@9 + pre 4@3")
    assert (row["prefill_tokens"], row["decode_tokens"], row["context_tokens"], row["num_seqs"]) == (4, 1, 16, 2)
    assert (row["decode_ctx"], row["prefill"], row["iters"]) == ([9], [[3, 4]], 1)
    assert row["measured_s"] > 0 and row["cuda_graph"] == (DEVICE == "cuda")
    assert lines[0].startswith("[1/1] dec 1@9 + pre 4@3")


def test_cli_quick_writes_rows(tmp_path, capsys):
    out = tmp_path / "rows.json"
    main(["--quick", "--out", str(out), "--dtype", "float32", *(["--device", DEVICE])])
    rows = json.loads(out.read_text())
    assert [r["batch"] for r in rows] == ["dec 1@5 + dec 1@17", "pre 8@0", "pre 5@7", "dec 1@9 + pre 4@3"]
    assert all(set(r) == COLUMNS for r in rows)
    assert capsys.readouterr().out.splitlines()[-1] == f"4 rows -> {out}"


def test_cli_quick_moe_and_grid_choice(tmp_path, monkeypatch, capsys):
    out = tmp_path / "rows.json"
    main(["--quick", "--moe", "--out", str(out), "--dtype", "float32", "--device", DEVICE])
    rows = json.loads(out.read_text())
    assert [r["model"] for r in rows] == ["tiny-moe"] * 4 and all(r["measured_s"] > 0 for r in rows)
    asked = []
    assert [r["moe_kernel"] for r in rows] == ["bmm"] * 4  # float32: no grouped GEMM
    asked = []
    monkeypatch.setattr(forward_step, "run_grid", lambda model, tp, device, dtype, grid, moe_kernel: asked.append(
        (model.name, tp, grid, moe_kernel)) or [])
    main(["--model", "qwen3-30b-a3b", "--grid", "holdout", "--out", str(out)])
    main(["--model", "qwen3-30b-a3b", "--grid", "holdout", "--moe-kernel", "bmm", "--out", str(out)])
    kernel = "grouped" if hasattr(torch, "_grouped_mm") else "bmm"
    assert asked == [("qwen3-30b-a3b", 1, holdout_grid("qwen3-30b-a3b"), kernel),
                     ("qwen3-30b-a3b", 1, holdout_grid("qwen3-30b-a3b"), "bmm")]
    with pytest.raises(SystemExit):
        main(["--quick", "--moe", "--dtype", "float32", "--moe-kernel", "grouped", "--out", str(out)])
    assert "--moe-kernel grouped needs --dtype bfloat16" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--model", "gpt-oss-20b", "--out", str(out)])
    assert "cannot build gpt-oss-20b: it has attention sinks" in capsys.readouterr().err
