"""GPU-harness tests: Triton runs in interpreter mode on CPU tensors when CUDA is absent.

TRITON_INTERPRET must be set before triton is first imported, hence here. The
folder is skipped (with the reason) when torch or triton is missing.
"""

import importlib.util
import os

import pytest

_MISSING = [m for m in ("torch", "triton") if importlib.util.find_spec(m) is None]
if _MISSING:
    pytest.skip(f"gpu tests need {' and '.join(_MISSING)} (pip install -e '.[gpu]')", allow_module_level=True)

from gpu_env import DEVICE, HAS_CUDA  # noqa: E402

if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)


@pytest.fixture
def device() -> str:
    return DEVICE
