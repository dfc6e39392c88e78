"""The synthetic forward step: Batch's cost-model arguments, the step against a float64
plain-torch forward of the same weights (mask alignment included), the grid and its rows."""

import json
import math

import pytest
import torch
from gpu_env import DEVICE

from kvsim.gpu.forward_step import (
    TINY,
    Batch,
    ForwardStep,
    decodes,
    default_grid,
    kv_capacity_tokens,
    main,
    quick_grid,
    run_grid,
)
from kvsim.sim.engine.catalog import get_gpu, get_model
from kvsim.sim.engine.cost_model import CostModel

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


def _ref_forward(step, s, prior_k, prior_v):
    """The whole step in float64 with plain torch, reading only the prior context from the cache."""
    w = {k: v.double().cpu() for k, v in vars(step).items() if isinstance(v, torch.Tensor)}
    heads, kvh, d = step.heads, step.kv_heads, step.head_dim
    seqs = s.batch.seqs()
    pos = torch.cat([torch.arange(p, p + n) for p, n in seqs])
    x = w["lm_head"][s.token_ids.cpu()]
    for _ in range(step.model.num_layers):
        qkv = _rms(x, w["norm_attn"]) @ w["w_qkv"].T
        q = _rope(qkv[:, : heads * d].view(-1, heads, d), pos)
        k = _rope(qkv[:, heads * d:(heads + kvh) * d].view(-1, kvh, d), pos)
        v = qkv[:, (heads + kvh) * d:].view(-1, kvh, d)
        bounds = torch.cumsum(torch.tensor([0] + [n for _, n in seqs]), 0).tolist()
        keys = [torch.cat((pk, k[a:b])) for pk, a, b in zip(prior_k, bounds[:-1], bounds[1:], strict=True)]
        values = [torch.cat((pv, v[a:b])) for pv, a, b in zip(prior_v, bounds[:-1], bounds[1:], strict=True)]
        x = x + _ref_attention(q, keys, values, seqs) @ w["w_o"].T
        gate, up = (_rms(x, w["norm_mlp"]) @ w["w_gate_up"].T).chunk(2, -1)
        x = x + (torch.nn.functional.silu(gate) * up) @ w["w_down"].T
    rows = torch.tensor(bounds[1:]) - 1
    return _rms(x[rows], w["norm_final"]) @ w["lm_head"].T


def test_forward_matches_float64_reference():
    step = ForwardStep(TINY, device=DEVICE, dtype=torch.float32, block_size=4)
    s = step.prepare(MIXED)
    prior_k = _context(step, s, s.key_cache, lambda p, n: p)
    prior_v = _context(step, s, s.value_cache, lambda p, n: p)
    logits = step.forward(s)
    assert logits.shape == (4, 128)
    ref = _ref_forward(step, s, prior_k, prior_v)
    torch.testing.assert_close(logits.double().cpu(), ref, atol=1e-3, rtol=1e-3)


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
