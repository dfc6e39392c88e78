"""Watermark admission: may a request's blocks be allocated now, later, or never?"""

from __future__ import annotations

from enum import Enum


class AllocStatus(Enum):
    """The v2 block manager's answer to `can_allocate` / `can_swap_in`."""

    OK = "ok"
    LATER = "later"
    NEVER = "never"


def watermark_status(num_required: int, num_free: int, num_total: int, watermark_blocks: int) -> AllocStatus:
    """vLLM v2 rule: NEVER if even an empty pool keeps fewer than the watermark
    free after this allocation; OK if the free pool does; LATER otherwise."""
    if num_total - num_required < watermark_blocks:
        return AllocStatus.NEVER
    if num_free - num_required >= watermark_blocks:
        return AllocStatus.OK
    return AllocStatus.LATER
