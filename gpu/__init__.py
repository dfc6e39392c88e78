"""gpu: Triton-backed paged KV storage and the op-stream replay harness (needs the gpu extra).

Nothing here is imported eagerly: `import gpu` works without torch or triton.
Entry points: `gpu.replay.replay_run`, `gpu.calibrate.calibrate`, the kernels in
`gpu.kernels` (importing it runs Triton in interpreter mode when CUDA is absent).
"""
