"""Packing a chunk group's parameters into chunks in first-use order (no memory yet)."""

from __future__ import annotations

from collections.abc import Callable

from tierwise.chunks import (
    Chunk,
    ChunkGroup,
    ParamSlot,
    SlotSpec,
    TensorState,
    first_use_order,
    pack,
    sharded_capacity,
)


def packed_chunks(
    group: ChunkGroup,
    order: list[str],
    numels: dict[str, int],
    chunk_size: int,
    make_slot: Callable[[SlotSpec], ParamSlot],
) -> list[Chunk]:
    """``group``'s parameters (``numels``: name -> elements, in the group's order) packed in
    first-use ``order`` into chunks of ``chunk_size`` (capacity rounded to whole shards);
    ``make_slot`` gives each packed parameter its slot."""
    chunks = []
    for spec in pack(first_use_order(order, list(numels)), numels, chunk_size):
        capacity, shard = sharded_capacity(spec.capacity, group.world, group.sharded)
        slots = [make_slot(s) for s in spec.slots]
        chunks.append(Chunk(group, spec.index, capacity, shard, slots))
    return chunks


def new_chunks(group: ChunkGroup, order: list[str], chunk_size: int) -> list[Chunk] | None:
    """``group``'s chunks packed in ``order``; None when that packing is the current one."""
    slots = {s.name: s for c in group.chunks for s in c.slots}
    numels = {s.name: s.numel for c in group.chunks for s in c.slots}

    def make_slot(s: SlotSpec) -> ParamSlot:
        old = slots[s.name]
        return ParamSlot(
            s.name,
            old.param,
            s.offset,
            s.numel,
            old.shape,
            state=TensorState.HOLD,
            has_grad=old.has_grad,
        )

    chunks = packed_chunks(group, order, numels, chunk_size, make_slot)
    if [[s.name for s in c.slots] for c in chunks] == [
        [s.name for s in c.slots] for c in group.chunks
    ]:
        return None
    return chunks
