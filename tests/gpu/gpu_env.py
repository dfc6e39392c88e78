"""Where the GPU tests run: CUDA if present, else CPU with Triton's interpreter (set in conftest)."""

import torch

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
