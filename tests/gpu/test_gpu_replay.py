"""End-to-end replays of recorded op streams: every computed token verified, 0 mismatches."""

from collections import Counter
from itertools import groupby

import gpu_scenarios as scenarios
import pytest
from gpu_env import DEVICE

from kvsim.gpu.backends import BACKENDS
from kvsim.gpu.replay import RunFilesError, load_run, replay_run
from kvsim.gpu.verify import IntegrityError
from kvsim.kvcache.ops import read_ops


@pytest.fixture(params=BACKENDS)
def kernels(request):
    return request.param


def _replay(run, kernels, **kw):
    """`replay_run` on DEVICE with `kernels`, checking decode attention on every layer with either."""
    kw.setdefault("attention_layers", kw.get("layers", 2))
    return replay_run(run, DEVICE, kernels=kernels, **kw)


def _expected_checks(ops, window_free=True):
    """Positions a replay reads back (each written sequence, 0..newest, every step) and decode checks."""
    tokens = decodes = 0
    for _, group in groupby(ops, key=lambda op: op.step):
        newest, count = {}, Counter()
        for op in group:
            if op.kind == "write":
                newest[op.seq] = max(newest.get(op.seq, 0), op.pos + op.c - op.b)
                count[op.seq] += op.c - op.b
        tokens += sum(newest.values())
        decodes += sum(1 for n in count.values() if n == 1)
    return tokens, decodes


@pytest.fixture(scope="module")
def lifecycle(tmp_path_factory):
    return scenarios.lifecycle(tmp_path_factory.mktemp("lifecycle"))


def test_lifecycle_covers_every_op_kind(lifecycle):
    run, facts = lifecycle
    assert facts == {
        "hit": 8, "swapped_out": [(6, 0), (7, 1), (10, 2)], "swapped_in": [(2, 13)],
        "moves": [(14, 1), (13, 2), (12, 3), (8, 4), (7, 5)], "cow": 1,
    }
    kinds = Counter(op.kind for op in read_ops(run / "ops.parquet"))
    assert kinds == {"write": 26, "table": 22, "free": 15, "move": 5, "swap_out": 3, "copy": 1, "swap_in": 1}


def test_lifecycle_replays_clean(lifecycle, kernels):
    run, _ = lifecycle
    rep = _replay(run, kernels)
    tokens, decodes = _expected_checks(read_ops(run / "ops.parquet"))
    assert rep.ok and rep.mismatches == 0 and rep.errors == []
    assert (rep.tokens_verified, rep.decode_checks) == (tokens, decodes) == (265, 17)
    assert rep.sequence_checks == 20 and rep.steps == rep.steps_checked == 8
    assert rep.units == {"write": 46, "copy": 1, "swap_out": 3, "swap_in": 1, "move": 5, "attention": 228}
    assert set(rep.measured_s) == {"write", "copy", "swap_out", "swap_in", "move", "attention"}
    assert rep.kernels == kernels and rep.attention_layers == 2
    assert rep.model == "llama-3-8b" and rep.predicted_s["copy"] == pytest.approx(2 * (128 << 10) * 4 / 3.35e12)
    assert rep.scale == rep.geometry["layers"] * 2 * 4 * 2 * 16 * 4 / ((128 << 10) * 4)
    assert "mismatches     0" in rep.format()


def test_check_every_skips_steps_and_fp16(lifecycle, kernels):
    run, _ = lifecycle
    rep = _replay(run, kernels, layers=1, kv_heads=1, head_dim=8, check_every=3, dtype="float16", q_per_kv=4)
    assert rep.ok and rep.steps_checked == 3  # steps 0, 3, 6; decodes: A and A/1, then A/1 and B
    assert rep.decode_checks == 4 and rep.dtype == "float16" and rep.geometry["heads"] == 4


def test_bfloat16_and_torch_swaps(lifecycle, kernels):
    run, _ = lifecycle
    rep = _replay(run, kernels, layers=1, dtype="bfloat16", swap_method="torch")
    assert rep.ok and rep.tokens_verified == 265


@pytest.mark.parametrize("window", [None, 8])
def test_concurrent_replay_with_preemption_and_sliding_window(tmp_path, window, kernels):
    run = scenarios.concurrent(tmp_path, sliding_window=window)
    ops = read_ops(run / "ops.parquet")
    holes = sum(1 for op in ops if op.kind == "table" and op.a == 0)
    assert (holes > 0) == (window is not None)
    rep = _replay(run, kernels)
    # the window hashes only each prompt's resumable tail (vLLM 0.33's retention 0), so nothing cached is evicted
    assert rep.ok and rep.decode_checks == 28 and rep.ops["evict"] == (2 if window is None else 0)
    tokens, _ = _expected_checks(ops)
    assert (rep.tokens_verified == tokens) == (window is None)  # a window's null blocks are not read back
    assert rep.units["attention"] < 352 if window else rep.units["attention"] == 352


def test_simulated_run_replays_clean(tmp_path, kernels):
    run = scenarios.simulated(tmp_path)
    rep = _replay(run, kernels)
    assert rep.ok and rep.ops["swap_out"] == 5 and rep.ops["swap_in"] == 2 and rep.ops["move"] == 9
    assert (rep.tokens_verified, rep.decode_checks) == _expected_checks(read_ops(run / "ops.parquet"))


def test_torch_kernels_check_decode_attention_only_when_asked(lifecycle):
    run, _ = lifecycle
    rep = replay_run(run, "cpu", layers=1)
    assert rep.ok and rep.kernels == "torch" and rep.tokens_verified == 265
    assert rep.attention_layers == rep.decode_checks == 0 and rep.measured_s.get("attention", 0.0) == 0.0
    assert "decode attention not checked (--attention-layers N checks it)" in rep.format()
    assert replay_run(run, "cpu", layers=1, attention_layers=1).decode_checks == 17


def test_missing_files_name_the_file_and_the_fix(tmp_path):
    with pytest.raises(RunFilesError, match=r"ops\.parquet: missing; record the op stream with `kvsim run --record-ops`"):
        load_run(tmp_path)
    with pytest.raises(RunFilesError, match="no such run folder"):
        load_run(tmp_path / "nope")


def test_config_must_cover_the_blocks_the_ops_use(lifecycle, tmp_path):
    run, _ = lifecycle
    for name in ("ops.parquet", "op_tokens.parquet"):
        (tmp_path / name).write_bytes((run / name).read_bytes())
    (tmp_path / "config.json").write_text('{"block_size": 4, "num_gpu_blocks": 10}')
    with pytest.raises(RunFilesError, match="num_gpu_blocks is 10, but the ops use block 15"):
        replay_run(tmp_path, DEVICE)


@pytest.mark.parametrize("scenario", ["lifecycle", "simulated"])
def test_touched_check_reads_only_changed_entries_and_stays_clean(tmp_path, scenario):
    run = scenarios.lifecycle(tmp_path)[0] if scenario == "lifecycle" else scenarios.simulated(tmp_path)
    full = replay_run(run, "cpu", layers=1)
    touched = replay_run(run, "cpu", layers=1, check="touched")
    assert full.ok and touched.ok and touched.check == "touched"
    assert (touched.steps_checked, touched.sequence_checks) == (full.steps_checked, full.sequence_checks)
    assert (full.tokens_verified, touched.tokens_verified) == {"lifecycle": (265, 129), "simulated": (743, 251)}[scenario]


@pytest.mark.parametrize("dtype", ["fp8", "fp8_e5m2"])
def test_fp8_cache_replays_clean_and_stores_values_over_their_scales(lifecycle, kernels, dtype):
    """An FP8 cache (vLLM's --kv-cache-dtype fp8 / fp8_e5m2) holds each value over its plane's scale
    (K 0.5, V 2): every op kind replays clean, decode attention included, and a stored byte is the
    value over its scale."""
    run, _ = lifecycle
    rep = replay_run(run, DEVICE, kernels=kernels, layers=1, dtype=dtype, kv_scales=(0.5, 2.0),
                     attention_layers=1, swap_method="torch" if dtype == "fp8_e5m2" else "kernel")
    assert rep.ok and rep.tokens_verified == 265 and rep.decode_checks == 17
    assert rep.dtype == {"fp8": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}[dtype]
    assert rep.scale == 1 * 2 * 4 * 2 * 16 * 1 / ((128 << 10) * 4)  # one byte a value


def test_fp8_storage_codec_and_scales():
    import torch

    from kvsim.gpu.storage import PagedKVStorage

    st = PagedKVStorage(1, 4, 2, 1, 4, dtype=torch.float8_e4m3fn, device="cpu", scales=(0.25, 4.0))
    assert (st.fp8, st.compute_dtype, st.block_bytes) == (True, torch.float16, 2 * 2 * 4)
    quarters = torch.tensor([-1.0, -0.75, 0.5, 0.75], dtype=torch.float16)
    planes = torch.stack([quarters, quarters]).view(1, 2, 1, 1, 4)
    st.scatter(torch.tensor([5]), planes)
    raw = st.slots()[0, :, 5, 0].float()
    assert raw.tolist() == [[-4.0, -3.0, 2.0, 3.0], [-0.25, -0.1875, 0.125, 0.1875]]
    assert torch.equal(st.gather(torch.tensor([5])), planes)
    assert st.movable(st.gpu).dtype == torch.uint8
    for scales, why in (((0.3, 1.0), "K scale 0.3: a power of two"), ((1.0, 128.0), "V scale 128: a power of two"),
                        ((1.0,), "one for K and one for V")):
        with pytest.raises(ValueError, match=why):
            PagedKVStorage(1, 4, 2, 1, 4, dtype=torch.float8_e4m3fn, device="cpu", scales=scales)
    with pytest.raises(ValueError, match="kv scales 2, 1: only an FP8 cache is scaled"):
        PagedKVStorage(1, 4, 2, 1, 4, dtype=torch.float16, device="cpu", scales=(2.0, 1.0))


def _decodes_compared(ops, sample):
    """Decode-attention comparisons of a replay that compares at most `sample` decodes a step."""
    total = 0
    for _, group in groupby(ops, key=lambda op: op.step):
        count = Counter()
        for op in group:
            if op.kind == "write":
                count[op.seq] += op.c - op.b
        total += min(sample, sum(1 for n in count.values() if n == 1))
    return total


@pytest.mark.parametrize("check", ["full", "touched"])
def test_attention_sample_compares_at_most_n_decodes_a_step(lifecycle, kernels, check):
    run, _ = lifecycle
    ops = read_ops(run / "ops.parquet")
    for sample, expected in ((1, 7), (2, 14), (3, 17)):  # decodes a step: 0, 2, 3, 2, 3, 3, 2, 2
        rep = _replay(run, kernels, layers=1, check=check, attention_sample=sample)
        assert rep.ok and rep.decode_checks == _decodes_compared(ops, sample) == expected
        assert rep.attention_sample == sample and f"(1 layers, at most {sample} a step)" in rep.format()
        # the kernel still runs on every decode; every K/V entry is read as without sampling
        assert rep.units["attention"] == _replay(run, kernels, layers=1, check=check).units["attention"]
        assert rep.tokens_verified == {"full": 265, "touched": 129}[check]


def test_attention_sample_takes_decodes_in_turn_and_finds_a_wrong_output(lifecycle, monkeypatch):
    """A decode kernel whose output is off on every row: each compared decode is reported, once per
    (layer, head); one a step, the one compared longest ago first (ties in written order), reaches
    every sequence that decodes. Steps 1-7 decode [A, A/1], [A, A/1, B], [A, A/1], [A, A/1, B],
    [A | A/1, B], [A/1, B], [A/1 | B] (`|`: the sequences before it are checked first, their blocks
    then freed), so A (never), A/1 (never), A (compared at 1, A/1 at 2), B (never), A (the first
    check's only decode), A/1 (compared at 2, B at 4), A/1 (the first check's only decode)."""
    run, _ = lifecycle
    from kvsim.gpu.backends import TorchBackend

    decode = TorchBackend.decode
    monkeypatch.setattr(TorchBackend, "decode", lambda self, *a, **kw: decode(self, *a, **kw) + 1.0)
    rep = replay_run(run, "cpu", layers=1, attention_layers=1, attention_sample=1, strict=False)
    assert rep.decode_checks == 7 and rep.mismatches == 7 * rep.geometry["heads"]
    assert [(m.step, m.seq) for m in rep.found] == [(1, "A"), (2, "A/1"), (3, "A"), (4, "B"), (5, "A"),
                                                    (6, "A/1"), (7, "A/1")]
    with pytest.raises(IntegrityError, match="attention"):
        replay_run(run, "cpu", layers=1, attention_layers=1, attention_sample=1)


def test_attention_sample_needs_attention_compared(lifecycle):
    run, _ = lifecycle
    with pytest.raises(ValueError, match="attention_sample 2 picks decodes to compare .* compares none"):
        replay_run(run, "cpu", layers=1, attention_sample=2)
    with pytest.raises(ValueError, match="attention_sample must be >= 1"):
        replay_run(run, "cpu", layers=1, attention_layers=1, attention_sample=0)
