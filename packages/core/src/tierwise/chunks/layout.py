"""Packing parameters into chunks (PatrickStar layout), shared by the engine and planners.

Parameters are placed in first-use order; a parameter that does not fit in the current chunk's
remaining room starts a new chunk (a parameter is never split); a parameter larger than the chunk
size gets a chunk of its own, exactly its size; a group's last chunk is exactly as large as what
it holds ([Note: chunk padding]).

[Note: chunk padding]
Every element of a chunk that no parameter uses still costs model data on every payload (2 bytes
of parameters and gradients, 12 of fp32 master and moments), so padding is what keeps the bytes
per parameter above PatrickStar's 14 (Invariant 10). Two things keep it small:
- A group's last chunk has no later parameter to make room for: its capacity is what it holds
  (rounded to whole shards when sharded). Chunks of unequal capacity are nothing new (an
  oversize parameter has a chunk of its own): an rCache block or a reduction block is as large
  as the largest chunk, and a smaller chunk uses its front.
- The chunk size is chosen to waste little (PatrickStar searches the size that fragments
  least): both planners try, besides their usual sizes, the sizes at which a run of consecutive
  parameters fills a chunk exactly (``filling_sizes``; a transformer's repeated blocks then pack
  with almost no gap), and keep only sizes whose padding is at most ``PADDING_LIMIT`` of the
  parameters when any does (``tierwise.planning.chunk_size``, the search's
  [Note: chunk size choice]). ``padding_at`` counts a size's padding without building chunks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SlotSpec:
    """Where one parameter lives: ``chunk`` index, element ``offset`` and ``numel``."""

    name: str
    chunk: int
    offset: int
    numel: int


@dataclass(frozen=True)
class ChunkSpec:
    """One chunk: its capacity in elements and the parameters packed in it."""

    index: int
    capacity: int
    slots: tuple[SlotSpec, ...]

    @property
    def used(self) -> int:
        return sum(s.numel for s in self.slots)


def first_use_order(order: Iterable[str], all_names: Sequence[str]) -> list[str]:
    """Deduplicate ``order`` keeping first uses; append never-used names in ``all_names`` order."""
    seen: dict[str, None] = {}
    known = set(all_names)
    for name in order:
        if name in known:
            seen.setdefault(name, None)
    for name in all_names:
        seen.setdefault(name, None)
    return list(seen)


def pack(names: Sequence[str], numels: dict[str, int], chunk_size: int) -> list[ChunkSpec]:
    """Pack ``names`` (already in the wanted order) into chunks of ``chunk_size`` elements."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    chunks: list[ChunkSpec] = []
    current: list[SlotSpec] = []
    filled = 0

    def close(capacity: int) -> None:
        nonlocal current, filled
        if current:
            chunks.append(ChunkSpec(len(chunks), capacity, tuple(current)))
        current, filled = [], 0

    for name in names:
        numel = numels[name]
        if numel > chunk_size:  # oversize: a chunk of its own
            close(chunk_size)
            chunks.append(ChunkSpec(len(chunks), numel, (SlotSpec(name, len(chunks), 0, numel),)))
            continue
        if filled + numel > chunk_size:
            close(chunk_size)
        current.append(SlotSpec(name, len(chunks), filled, numel))
        filled += numel
    close(filled)  # the last chunk holds only what it packs: [Note: chunk padding]
    return chunks


def padding(chunks: Sequence[ChunkSpec]) -> int:
    """Elements allocated but not used by any parameter."""
    return sum(c.capacity - c.used for c in chunks)


def padding_at(numels: Sequence[int], chunk_size: int) -> int:
    """Padding elements (before any rounding to whole shards) of ``numels`` (one group's
    parameter sizes, in packing order) packed into chunks of ``chunk_size``: ``padding(pack(...))``
    without building the chunks ([Note: chunk padding])."""
    wasted = filled = 0
    for numel in numels:
        if numel > chunk_size:  # oversize: a chunk of its own, the current one closes
            wasted += chunk_size - filled if filled else 0
            filled = 0
            continue
        if filled + numel > chunk_size:
            wasted += chunk_size - filled
            filled = 0
        filled += numel
    return wasted  # the last chunk is as large as what it holds


def filling_sizes(groups: Iterable[Sequence[int]], low: int, high: int, align: int) -> list[int]:
    """Chunk sizes in [``low``, ``high``], multiples of ``align``, at which some run of
    consecutive parameters of a group (sizes in packing order) fills a chunk up to the
    alignment: the sizes worth trying for little padding ([Note: chunk padding])."""
    sizes = set()
    for numels in groups:
        for start in range(len(numels)):
            run = 0
            for numel in numels[start:]:
                run += numel
                size = -(-run // align) * align
                if size > high:
                    break
                if size >= low:
                    sizes.add(size)
    return sorted(sizes)


def sharded_capacity(capacity: int, world: int, sharded: bool) -> tuple[int, int]:
    """(capacity, shard size) of a chunk packed to ``capacity`` elements: when sharded over
    ``world`` ranks the capacity is rounded up to a multiple of ``world`` so every rank's shard
    is the same size; unsharded, the shard is the whole chunk."""
    if not sharded:
        return capacity, capacity
    rounded = -(-capacity // world) * world
    return rounded, rounded // world
