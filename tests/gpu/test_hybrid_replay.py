"""gpu-replay of runs in vLLM's hybrid KV-cache groups: one storage indexed by block id, a table per
(sequence, group), values that depend on the group; Mamba state pages checked whole."""

from __future__ import annotations

import json
from collections import Counter

import gpu_scenarios as scenarios
import pytest

from kvsim.gpu.replay import RunFilesError, load_run, replay_ops, replay_run
from kvsim.kvcache.ops import Op

SMALL = {"layers": 1, "kv_heads": 1, "head_dim": 8}


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """gpt-oss-20b: a sliding window of 128 (group 0) and full attention (group 1), blocks of 16."""
    return scenarios.hybrid(tmp_path_factory.mktemp("gpt-oss") / "run", "gpt-oss-20b")


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    """qwen3-next-80b-a3b at TP 4: three Mamba groups and full attention, blocks of 320."""
    return scenarios.hybrid(tmp_path_factory.mktemp("qwen3-next") / "run", "qwen3-next-80b-a3b", 4, 12)


def _ops(run):
    ops, tokens, config = load_run(run)
    return ops, tokens, config


def test_config_names_the_groups(gpt_oss, qwen3_next):
    assert json.loads((gpt_oss / "config.json").read_text())["kv_cache_groups"] == [
        {"block_size": 16, "kind": "sliding_window", "window": 128}, {"block_size": 16, "kind": "full", "window": None}]
    assert [g["kind"] for g in json.loads((qwen3_next / "config.json").read_text())["kv_cache_groups"]] == [
        "mamba", "mamba", "mamba", "full"]


def test_a_window_and_full_attention_replay_clean(gpt_oss):
    ops, _, _ = _ops(gpt_oss)
    kinds = Counter((op.kind, op.group) for op in ops)
    assert kinds[("table", 0)] > 0 and kinds[("free", 0)] > 0 and kinds[("evict", 1)] > 0
    assert sum(1 for op in ops if op.kind == "table" and op.a == 0 and op.group == 0) > 0  # the window's nulls
    rep = replay_run(gpt_oss, "cpu", **SMALL)
    assert rep.ok and rep.errors == []
    assert (rep.tokens_verified, rep.sequence_checks) == (244000, 1222)


def test_mamba_groups_replay_clean(qwen3_next):
    rep = replay_run(qwen3_next, "cpu", **SMALL)
    assert rep.ok and rep.errors == []
    assert (rep.tokens_verified, rep.sequence_checks) == (756077, 2480)


def _first_decode(ops, group):
    return next(i for i, op in enumerate(ops) if op.kind == "write" and op.group == group and op.c - op.b == 1
                and op.pos > 200)


def test_a_lost_write_in_the_window_is_caught(gpt_oss):
    ops, tokens, config = _ops(gpt_oss)
    i = _first_decode(ops, 0)
    op = ops.pop(i)
    rep = replay_ops(ops, tokens, config, strict=False, **SMALL)
    assert rep.mismatches > 0
    first = rep.found[0]
    # the step that lost it wrote nothing else of the sequence in the window: the next step's read finds it
    assert (first.step, first.seq, first.position, first.block) == (op.step + 1, op.seq, op.pos, op.a)


def test_a_block_read_through_the_wrong_group_is_caught(gpt_oss):
    """The full-attention table (group 1) pointed at the window's block for the same entry: the same
    tokens, but group 0's values, so every position of it is wrong."""
    ops, tokens, config = _ops(gpt_oss)
    i = _first_decode(ops, 0)
    window_block, seq, entry = ops[i].a, ops[i].seq, ops[i].pos // 16
    j = max(k for k, op in enumerate(ops[:i]) if op.kind == "table" and op.group == 1 and op.seq == seq
            and op.b == entry)
    ops[j] = Op(ops[j].step, "table", window_block, entry, seq=seq, group=1)
    rep = replay_ops(ops, tokens, config, strict=False, **SMALL)
    assert rep.mismatches > 0
    assert rep.found[0].seq == f"{seq}@g1" and rep.found[0].block == window_block


def test_a_stale_mamba_state_is_caught(qwen3_next):
    """A decode's state write standing for one token less: the page the request reads then stands for
    another position than the tokens the request computed (its attention groups' newest), wrong whole."""
    ops, tokens, config = _ops(qwen3_next)
    i = _first_decode(ops, 1)
    op = ops[i]
    ops[i] = Op(op.step, "write", op.a, op.b - 1, op.c - 1, op.seq, pos=op.pos - 1, group=1)
    rep = replay_ops(ops, tokens, config, strict=False, **SMALL)
    assert rep.found[0].step == op.step and rep.found[0].seq == f"{op.seq}@g1" and rep.found[0].block == op.a
    assert rep.mismatches == 320  # every slot of the page


def test_a_lost_mamba_state_write_is_caught(qwen3_next):
    ops, tokens, config = _ops(qwen3_next)
    op = ops.pop(_first_decode(ops, 2))
    rep = replay_ops(ops, tokens, config, strict=False, **SMALL)
    assert (rep.found[0].step, rep.found[0].seq, rep.found[0].block) == (op.step, f"{op.seq}@g2", op.a)


def test_a_hybrid_stream_without_its_groups_is_refused(gpt_oss, tmp_path):
    ops, tokens, config = _ops(gpt_oss)
    del config["kv_cache_groups"]
    with pytest.raises(RunFilesError, match=r"^config.json: the op stream has KV-cache groups 0 to 1 but no "
                                            r"'kv_cache_groups' \(each group's kind, window and block_size\)"):
        replay_ops(ops, tokens, config, **SMALL)
    config["kv_cache_groups"] = [{"kind": "full", "window": None, "block_size": 16}]
    with pytest.raises(RunFilesError, match="names 1 groups, but the op stream has group 1"):
        replay_ops(ops, tokens, config, **SMALL)


def test_the_cli_replays_a_hybrid_run_and_refuses_to_inject_faults_into_it(gpt_oss):
    from typer.testing import CliRunner

    from kvsim.sim.cli.app import app

    runner = CliRunner()
    small = ["--device", "cpu", "--layers", "1", "--kv-heads", "1", "--head-dim", "8"]
    r = runner.invoke(app, ["gpu-replay", str(gpt_oss), *small])
    assert r.exit_code == 0, r.output
    assert "ops            evict 222, free 421, table 675, write 1,472\n" in r.output
    assert "verified       244,000 tokens in 1,222 sequence checks" in r.output
    assert "mismatches     0\n" in r.output
    r = runner.invoke(app, ["gpu-replay", str(gpt_oss), *small, "--inject-faults", "3"])
    assert r.exit_code == 2
    assert r.stderr == (f"error: --inject-faults: {gpt_oss}'s stream has 2 KV-cache groups, and the fault injector "
                        "knows one block table a sequence; replay it without faults (or record the run with "
                        "--disable-hybrid-kv-cache-manager)\n")
