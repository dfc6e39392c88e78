"""How many host chunks `--kv-offloading-size` buys, as vLLM 0.33's `CPUOffloadingSpec.__init__`
(vllm/v1/kv_offload/cpu/spec.py)."""

from __future__ import annotations

PAGE_BYTES = 4096  # vLLM's BLOCK_SIZE_ALIGNMENT, mmap.PAGESIZE on the usual Linux hosts


def num_host_chunks(size_gib: float, bytes_per_block: int, world_size: int,
                    blocks_per_chunk: int = 1) -> int:
    """floor(size_gib * 2^30 / round_up(bytes_per_block * world_size * blocks_per_chunk, 4096)).

    `bytes_per_block` is one worker's bytes per GPU block (all its layers); the size
    is the total over all `world_size` workers, each chunk holding every worker's copy.
    """
    for name, value in (("bytes_per_block", bytes_per_block), ("world_size", world_size),
                        ("blocks_per_chunk", blocks_per_chunk)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if not size_gib > 0:
        raise ValueError(f"kv offloading size must be positive GiB, got {size_gib}")
    chunk_bytes = bytes_per_block * world_size * blocks_per_chunk
    aligned = -(-chunk_bytes // PAGE_BYTES) * PAGE_BYTES
    return int(size_gib * (1 << 30)) // aligned
