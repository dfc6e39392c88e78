"""Durations in the unit a person reads, for the summary table and the plots alike."""

from __future__ import annotations


def seconds(v: float | None) -> str:
    """A duration: 12.3 ms below a second, 4.56 s, 12.3 min, 2.2 h; "-" for none."""
    if v is None:
        return "-"
    if v < 1:
        return f"{1000 * v:.1f} ms"
    if v < 60:
        return f"{v:.2f} s"
    if v < 3600:
        return f"{v / 60:.1f} min"
    return f"{v / 3600:,.1f} h"


def axis(v: float) -> tuple[float, str]:
    """The factor and unit for an axis of durations reaching `v` seconds: ms below a second, s below
    two minutes, min below two hours, h beyond (seconds x factor is the value drawn)."""
    if v < 1:
        return 1e3, "ms"
    if v < 120:
        return 1.0, "s"
    if v < 7200:
        return 1 / 60, "min"
    return 1 / 3600, "h"
