"""`python -m sim.conform`: both vLLM reference drivers on two requests sharing a block
(run by .ci/install_vllm_cpu.sh to prove the CPU-only install works)."""

from __future__ import annotations

from kvsim.sim.conform.vllm_cache import replay_manager
from kvsim.sim.conform.vllm_scheduler import run_scheduler
from kvsim.sim.conform.vllm_setup import vllm_available, vllm_version
from kvsim.workloads.request import make_request


def _selfcheck() -> None:
    """Both drivers on two requests sharing a block; exits with a message if either is wrong."""
    msg = vllm_available()
    if msg is not None:
        raise SystemExit(msg)
    reqs = [make_request(f"r{i}", float(i), list(range(20)), 2) for i in range(2)]
    hits = [r["hit_tokens"] for r in replay_manager(reqs, block_size=16, num_blocks=8)]
    steps = run_scheduler(reqs, block_size=16, num_gpu_blocks=8, max_num_batched_tokens=32,
                          max_num_seqs=2)
    got = (hits, [(s["hit_tokens"], s["finish_step"]) for s in steps])
    if got != ([0, 16], [(0, 1), (16, 2)]):
        raise SystemExit(f"vLLM self-check failed: got {got}")
    print(f"vLLM {vllm_version()}: both reference drivers run")


if __name__ == "__main__":
    _selfcheck()
