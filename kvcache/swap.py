"""The CPU block pool that preemption by swapping moves blocks into."""

from __future__ import annotations

from kvcache.block_pool import OutOfBlocksError


class CpuPool:
    """CPU blocks 0..n-1 with ref counts; a stack of free ids, as in vLLM's first allocator."""

    def __init__(self, num_blocks: int):
        if num_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfBlocksError(f"out of CPU blocks ({self.num_blocks} in all)")
        cpu = self._free.pop()
        self.ref[cpu] = 1
        return cpu

    def share(self, cpu: int) -> None:
        self.ref[cpu] += 1

    def free(self, cpu: int) -> None:
        if not 0 <= cpu < self.num_blocks:
            raise ValueError(f"unknown CPU block {cpu}")
        if self.ref[cpu] <= 0:
            raise ValueError(f"double free of CPU block {cpu}")
        self.ref[cpu] -= 1
        if self.ref[cpu] == 0:
            self._free.append(cpu)
