"""Compiled (CUDA) or interpreted (CPU) Triton: chosen once, before the first kernel is defined."""

from __future__ import annotations

import os
import sys


def use_interpreter_without_cuda() -> None:
    """Set TRITON_INTERPRET=1 when CUDA is unavailable, unless the variable is already set."""
    if "TRITON_INTERPRET" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            if "triton" in sys.modules:
                raise RuntimeError("no CUDA, and triton was imported before TRITON_INTERPRET=1 was set: "
                                   "set it before importing triton (or import gpu.kernels first)")
            os.environ["TRITON_INTERPRET"] = "1"


def interpreting() -> bool:
    """True when kernels run in Triton's interpreter (CPU tensors work, CUDA timing means nothing)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
