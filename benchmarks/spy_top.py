"""Summarise a py-spy raw profile (`py-spy record -f raw`): the functions holding the most samples,
by their own time and with their callees, as shares of all samples.

    python benchmarks/spy_top.py PROFILE [--top 25]

Used by `gpu_session.sh profile` to say where a replay's host time goes on the GPU machine, where
the kernels differ from the CPU's and a CPU profile would mislead.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path


def tally(path: Path) -> tuple[int, Counter, Counter]:
    """Samples in all, per frame as the innermost one (own time), per frame anywhere in the stack."""
    own: Counter = Counter()
    anywhere: Counter = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        own[frames[-1]] += n
        for frame in set(frames):
            anywhere[frame] += n
    return total, own, anywhere


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile", type=Path)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    total, own, anywhere = tally(args.profile)
    if not total:
        raise SystemExit(f"{args.profile}: no samples")
    for title, counts in (("own time", own), ("with callees", anywhere)):
        print(f"{title} ({total:,} samples)")
        for frame, n in counts.most_common(args.top):
            print(f"{n / total:6.1%}  {frame}")


if __name__ == "__main__":
    main()
