"""Packing parameters into chunks (PatrickStar layout), shared by the engine and planners.

Parameters are placed in first-use order; a parameter that does not fit in the current chunk's
remaining room starts a new chunk (a parameter is never split); a parameter larger than the chunk
size gets a chunk of its own, exactly its size. Every other chunk, the last one included, has
``chunk_size`` elements, so what padding costs is decided by the chunk size alone ([Note: chunk
padding] in tierwise.planning.chunk_size).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np


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
    close(chunk_size)
    return chunks


def padding(chunks: Sequence[ChunkSpec]) -> int:
    """Elements allocated but not used by any parameter."""
    return sum(c.capacity - c.used for c in chunks)


def sharded_capacity(capacity: int, world: int, sharded: bool) -> tuple[int, int]:
    """(capacity, shard size) of a chunk packed to ``capacity`` elements: when sharded over
    ``world`` ranks the capacity is rounded up to a multiple of ``world`` so every rank's shard
    is the same size; unsharded, the shard is the whole chunk."""
    if not sharded:
        return capacity, capacity
    rounded = -(-capacity // world) * world
    return rounded, rounded // world


def padding_by_size(groups: Sequence[Sequence[int]], sizes: Sequence[int]) -> np.ndarray:
    """Padding elements of every group packed at each chunk size of ``sizes``: ``padding(pack(
    ...))`` summed over ``groups`` (each group's parameter sizes in packing order), for all the
    sizes at once (one pass over the parameters, the sizes side by side)."""
    size = np.asarray(sizes, dtype=np.int64)
    wasted = np.zeros_like(size)
    for numels in groups:
        filled = np.zeros_like(size)
        for numel in numels:
            oversize = numel > size  # a chunk of its own (no padding); the current one closes
            full = ~oversize & (filled + numel > size)
            closes = (oversize | full) & (filled > 0)
            wasted += np.where(closes, size - filled, 0)
            filled = np.where(oversize, 0, np.where(full, 0, filled) + numel)
        wasted += np.where(filled > 0, size - filled, 0)  # the last chunk is chunk_size too
    return wasted


def filling_sizes(groups: Iterable[Sequence[int]], low: int, high: int, align: int) -> set[int]:
    """Chunk sizes in [``low``, ``high``], multiples of ``align``, that some run of consecutive
    parameters of a group (sizes in packing order) fills up to the alignment: where chunks can
    end with little padding."""
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
    return sizes
