"""Bucket ladders: the padded sizes every executable is compiled for (geometric, powers of two by default)."""

from __future__ import annotations

import bisect


def geometric_ladder(smallest: int, largest: int, ratio: int = 2) -> tuple[int, ...]:
    """`smallest` times powers of `ratio` up to `largest`, with `largest` itself always the top rung."""
    if smallest < 1 or largest < 1:
        raise ValueError(f"ladder bounds must be >= 1, got {smallest}..{largest}")
    rungs = []
    size = smallest
    while size < largest:
        rungs.append(size)
        size *= ratio
    rungs.append(largest)
    return tuple(rungs)


def pick_bucket(ladder: tuple[int, ...], size: int) -> int:
    """The smallest rung that holds `size`; a ValueError when none does."""
    index = bisect.bisect_left(ladder, size)
    if index == len(ladder):
        raise ValueError(f"size {size} exceeds the largest bucket {ladder[-1]}")
    return ladder[index]
