"""Core's "auto" chunk size: about ``AUTO_CHUNKS`` chunks, padding weighed ([Note: chunk padding]
in tierwise.chunks.layout).

The sizes tried run from the largest parameter to a few times the aim (one ``AUTO_CHUNKS``-th of
the parameters): a grid, and the sizes at which runs of consecutive parameters fill a chunk
(``filling_sizes``). Those wasting at most ``PADDING_LIMIT`` of the parameters are tried nearest
the aim first (when none does, the least wasteful ones), then the aim itself (the size core
chose before padding was weighed). The planner takes the first size whose plan fits the
budgets.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from tierwise.chunks.layout import filling_sizes, padding_at

AUTO_CHUNKS = 16
"""'auto' chunk size aims at about this many chunks (never below the largest parameter)."""

PADDING_LIMIT = 1 / 30
"""Padding (elements no parameter uses) allowed in a chosen chunk size, as a fraction of the
parameters: 14 bytes per element become at most 14 x 31/30 = 14.47 bytes per parameter, under
the 14.5 of issue 36 with a little room for rounding sharded chunks to whole shards ([Note:
chunk padding])."""

ALIGN = 64
"""Core's chunk sizes are multiples of this many elements."""

GRID = 32
"""Evenly spaced sizes tried beside the filling ones."""

TRIED = 8
"""Sizes the planner tries at most before it gives up on fitting the budgets."""

SPAN = 4
"""Sizes up to this many times the aim (or the largest parameter) are tried."""


def aim(total: int, largest: int) -> int:
    """The size of ``AUTO_CHUNKS`` equal chunks, rounded up to 1024 elements, never below the
    largest parameter or 1024."""
    target = -(-total // AUTO_CHUNKS)
    return max(largest, -(-target // 1024) * 1024, 1024)


def padding_of(groups: Sequence[Sequence[int]], chunk_size: int) -> int:
    """Padding elements of every group packed at ``chunk_size``."""
    return sum(padding_at(numels, chunk_size) for numels in groups)


def auto_chunk_sizes(groups: Sequence[Sequence[int]]) -> list[int]:
    """Chunk sizes to try, best first, for chunk groups whose parameter sizes (in packing
    order) are ``groups`` (see the module docstring)."""
    sizes = [n for numels in groups for n in numels]
    total, largest = sum(sizes), max(sizes)
    goal = aim(total, largest)
    low = max(-(-largest // ALIGN) * ALIGN, 1024)
    high = max(low, SPAN * goal)
    step = max(ALIGN, (high - low) // (GRID - 1) // ALIGN * ALIGN)
    tried = set(range(low, high + 1, step)) | set(filling_sizes(groups, low, high, ALIGN))
    waste = {size: padding_of(groups, size) for size in tried}
    nearest = lambda size: abs(math.log(size / goal))  # noqa: E731
    lean = sorted((s for s in tried if waste[s] <= PADDING_LIMIT * total), key=nearest)
    ordered = (lean or sorted(tried, key=waste.get))[: TRIED - 1]
    return ordered if goal in ordered else [*ordered, goal]


__all__ = ["AUTO_CHUNKS", "PADDING_LIMIT", "aim", "auto_chunk_sizes", "padding_of"]
