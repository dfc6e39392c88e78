"""Triton kernels on paged KV blocks, one per module, each with a plain-torch twin in `gpu.reference`.

Importing this package switches Triton to interpreter mode (TRITON_INTERPRET=1)
when CUDA is unavailable, so the same kernels run on CPU tensors. Set the
variable yourself before the first import to force either mode.
"""

from kvsim.gpu.kernels.mode import interpreting, use_interpreter_without_cuda

use_interpreter_without_cuda()

from kvsim.gpu.kernels.copy_blocks import copy_blocks  # noqa: E402
from kvsim.gpu.kernels.count_wrong import count_wrong  # noqa: E402
from kvsim.gpu.kernels.decode_attention import decode_attention  # noqa: E402
from kvsim.gpu.kernels.exchange_blocks import exchange_blocks  # noqa: E402
from kvsim.gpu.kernels.swap_blocks import SWAP_METHODS, swap_blocks  # noqa: E402
from kvsim.gpu.kernels.write_kv import write_kv, write_kv_layers  # noqa: E402

__all__ = [
    "SWAP_METHODS", "copy_blocks", "count_wrong", "decode_attention", "exchange_blocks", "interpreting", "swap_blocks", "write_kv",
    "write_kv_layers",
]
