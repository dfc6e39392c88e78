"""gpu: Triton-backed paged KV storage and the op-stream replay harness (needs the gpu extra)."""
