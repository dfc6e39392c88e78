#!/usr/bin/env bash
# Install vLLM 0.33.0 on a CPU-only machine, for `kvsim conform` and tests/sim/conform/test_vllm_ref.py.
#
# kvsim drives only vLLM's scheduler and KV-cache manager (sim/conform/vllm_cache.py). The vllm wheel
# declares a CUDA torch 2.14 and ~80 GPU and serving packages, so it goes in with --no-deps,
# followed by exactly what those modules import (.ci/vllm-cpu-requirements.txt, the whole
# closure, also --no-deps so nothing can pull a CUDA torch). torch (CPU) must already be
# installed (`pip install torch==2.13.0`); this script checks it is left unchanged.
# Run from anywhere; PYTHON picks the interpreter (default: python).
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python}"

torch_version() { "$py" -c 'import torch; print(torch.__version__)'; }
if ! before="$(torch_version 2>/dev/null)"; then
    echo "install_vllm_cpu.sh: torch is not importable; install the CPU build first" \
        "(pip install torch==2.13.0)" >&2
    exit 1
fi

"$py" -m pip install --no-deps vllm==0.33.0
"$py" -m pip install --no-deps -r .ci/vllm-cpu-requirements.txt

after="$(torch_version)"
if [ "$before" != "$after" ]; then
    echo "install_vllm_cpu.sh: torch changed from $before to $after; it must stay the CPU build" >&2
    exit 1
fi

# Both reference drivers on a two-request workload; the first run also has vLLM inspect the
# Llama model class once (~15 s) and cache it under ~/.cache/vllm, so later runs start fast.
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$py" -m kvsim.sim.conform
