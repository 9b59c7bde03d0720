"""Chunk sizes that waste little padding, for core's "auto" chunk size and the search's candidates.

[Note: chunk padding]
Every chunk element no parameter uses still costs model data on every payload (2 bytes of
parameters and gradients, 12 of fp32 master and moments), so padding is what keeps the bytes per
parameter above the 14 of PatrickStar (issue 36 asks for at most 14.5). Chunks are never trimmed:
every chunk but an oversize parameter's own is ``chunk_size`` elements, the last one of a group
too, so the runtime, both planners, ``planning.totals``, ``payload.model_data_by_tier`` and the
search's cost model count the same bytes from one number, with any world size and state format
(sharded capacities and int8 blocks stay as they were). What changes is the choice of the size:
- Sizes are tried where chunks can end with little padding: an even grid and the sizes that a run
  of consecutive parameters fills (``filling_sizes``; a transformer's repeated blocks then pack
  with almost no gap, the last chunk included).
- Only sizes whose padding (``padding_by_size``, exact: core's packing) is at most
  ``PADDING_LIMIT`` of the parameters are kept when any is (``lean_sizes``); otherwise each
  planner keeps its sizes of before (core: its aim; the search: its grid).
- A plan that fits comes first: the search tries its padded grid sizes when no lean size fits
  the budgets ([Note: chunk size choice]); core tries lean sizes only at or below its aim, whose
  rCache blocks and storage staging are no larger (``auto_chunk_sizes``), then the aim.
PatrickStar likewise searches the chunk size that fragments least.
"""

from __future__ import annotations

from collections.abc import Sequence

from tierwise.chunks.layout import filling_sizes, padding_by_size

PADDING_LIMIT = 0.03
"""Padding allowed in a chosen chunk size, as a share of the parameters: 14 bytes per element are
then at most 14 x 1.03 = 14.42 bytes per parameter, under issue 36's 14.5."""

GRID = 32
"""Evenly spaced sizes tried beside the filling ones."""


def grid_sizes(low: int, high: int, align: int) -> list[int]:
    """Up to ``GRID`` sizes evenly spread over [``low``, ``high``], multiples of ``align`` (``low``
    is one)."""
    count = min(GRID, (high - low) // align + 1)
    step = (high - low) / max(count - 1, 1) / align
    return sorted({low + round(i * step) * align for i in range(count)})


def lean_sizes(groups: Sequence[Sequence[int]], low: int, high: int, align: int) -> list[int]:
    """The grid and filling sizes in [``low``, ``high``] (multiples of ``align``; ``low`` is one)
    that waste at most ``PADDING_LIMIT`` of the parameters, smallest first (none when every size
    wastes more), for chunk groups whose parameter sizes in packing order are ``groups``
    ([Note: chunk padding])."""
    tried = sorted(set(grid_sizes(low, high, align)) | filling_sizes(groups, low, high, align))
    waste = padding_by_size(groups, tried)
    limit = PADDING_LIMIT * sum(sum(numels) for numels in groups)
    return [size for size, wasted in zip(tried, waste.tolist(), strict=True) if wasted <= limit]


AUTO_CHUNKS = 16
"""Core's "auto" chunk size aims at about this many chunks (never below the largest parameter)."""

AUTO_ALIGN = 1024
"""Core's "auto" chunk sizes are multiples of this many elements (or the largest parameter)."""

AUTO_TRIED = 4
"""Lean sizes core's planner tries, largest first, before its aim."""


def auto_aim(total: int, largest: int) -> int:
    """``AUTO_CHUNKS`` equal chunks, rounded up to ``AUTO_ALIGN``, never below the largest
    parameter or ``AUTO_ALIGN``: core's "auto" size before padding was weighed."""
    target = -(-total // AUTO_CHUNKS)
    return max(largest, -(-target // AUTO_ALIGN) * AUTO_ALIGN, AUTO_ALIGN)


def auto_chunk_sizes(groups: Sequence[Sequence[int]]) -> list[int]:
    """Core's "auto" chunk sizes to try, best first: the aim when it wastes little; otherwise
    the lean sizes (``lean_sizes``) from the largest parameter up to the aim, largest first
    (at most ``AUTO_TRIED``), then the aim. Never above the aim: a smaller chunk needs no larger
    rCache block, gradient block or storage tier's staging than the aim's, which core's
    planner does not count (a storage tier's buffers are the plugin's: [Note: storage tiers'
    host buffers]), so padding weighed never makes a plan that fitted at the aim overflow."""
    total = sum(sum(numels) for numels in groups)
    largest = max(max(numels) for numels in groups)
    aim = auto_aim(total, largest)
    if padding_by_size(groups, [aim])[0] <= PADDING_LIMIT * total:
        return [aim]  # the aim itself wastes little: core's size as before
    low = max(-(-largest // AUTO_ALIGN) * AUTO_ALIGN, AUTO_ALIGN)
    lean = lean_sizes(groups, low, aim, AUTO_ALIGN) if low <= aim else []
    return [*sorted(lean, reverse=True)[:AUTO_TRIED], aim]


__all__ = [
    "AUTO_CHUNKS",
    "PADDING_LIMIT",
    "auto_aim",
    "auto_chunk_sizes",
    "grid_sizes",
    "lean_sizes",
]
