"""`kvsim model`: the catalog, and what kvsim reads from a model and makes of it, without a run."""

from __future__ import annotations

from typer.testing import CliRunner

from kvsim.sim.cli.app import app

runner = CliRunner()


def _out(*args: str) -> str:
    r = runner.invoke(app, ["model", *args])
    assert r.exit_code == 0, r.output
    return " ".join(r.output.split())


def test_the_catalog_lists_every_model_with_its_layers():
    out = _out()
    assert "gemma-3-27b 27.43B (27.01B active) 62 layers: 52 sliding window 1,024, 10 full attention" in out
    assert "llama-3-8b 8.03B 32 layers: 32 full attention" in out
    assert out.count(" layers: ") == 15


def test_a_model_says_what_it_read_its_blocks_and_its_steps_against_the_roofline():
    out = _out("gpt-oss-20b")
    # vLLM's hybrid KV-cache groups, as on a CUDA host: 155,104 blocks where the fallback holds 77,552
    assert "blocks: 155,104 of 16 tokens on 1 x h100-sxm, one pool for 2 groups (a request holds blocks in each)" in out
    assert ("KV-cache groups (vLLM 0.33's hybrid manager, one pool of 155,104 blocks of 16 tokens, 393,216 bytes "
            "each): 0: sliding window 128, layers 0-22 every 2nd; 1: full attention, layers 1-23 every 2nd") in out
    assert "step, decode 64 x 2k: 7.41 ms (memory-bound; the roofline's 5.13 ms)" in out
    fp8 = _out("deepseek-v3", "--gpu", "h200", "--tp", "8", "--kv-cache-dtype", "fp8")
    assert "blocks: 88,254 of 16 tokens" in fp8 and "562,176 bytes a block" in fp8
    nxt = _out("qwen3-next-80b-a3b", "--tp", "4")  # Mamba groups: the block size raised to hold a state
    assert "blocks: 8,961 of 320 tokens on 4 x h100-sxm, one pool for 4 groups" in nxt
    assert "block size: 320 tokens, not 16" in nxt and "step, prefill 2k: 17.68 ms" in nxt


def test_an_unknown_model_names_the_whole_catalog_and_exits_2():
    r = runner.invoke(app, ["model", "gpt-9"])
    assert r.exit_code == 2
    assert "error: unknown model 'gpt-9'; choose from llama-3-8b" in r.output
    assert "qwen3-next-80b-a3b, or give the path of a config.json" in " ".join(r.output.split())
