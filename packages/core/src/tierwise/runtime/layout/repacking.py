"""The host memory re-packing one payload kind holds, and its values gathered a piece at a time.

[Note: re-packing holds host memory]
Re-packing a kind of a chunk group ([Note: re-layout after warm-up]) builds each new chunk's
shard (this rank's values in the new layout) in a host buffer from the old chunks it draws on:
each old chunk is read (its slab copied to the host, low-bit moments decoded, a sharded chunk
all-gathered), one at a time. That is host memory outside every slab, so it is counted: the
bytes a kind holds at most (``kind_holding``) are reserved in the host tier while it moves and
counted in the ledger's ``relayout_buffers`` pool, and ``relayout`` checks them against the host
tier's room before any group moves; a group whose kind does not fit keeps its layout with a note.

How much is held depends on where the new slabs can go:
- **in pieces** when the kind's tiers have room for its new slabs beside the old ones: the new
  slabs are allocated first and written one new chunk at a time, then the old ones released.
  The host holds one new shard and one old chunk read, whatever the model's size.
- **whole** otherwise (the old slabs must be released before the new ones fit): every new shard
  of the kind is built before the old slabs go, so the host holds the kind's shards of the group
  plus one old chunk read.
Both gather in the same order (new chunk by new chunk, its old chunks in order), so ranks that
all-gather sharded chunks call the same collectives whichever way each of them holds the values.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tierwise.chunks import Chunk, ChunkGroup
from tierwise.chunks.io import gather_chunk, read_slab
from tierwise.chunks.payload import PayloadSpec, slab_of
from tierwise.precision import OPTIM_STATES

if TYPE_CHECKING:
    from tierwise.optim.state_formats import MomentFormat
    from tierwise.parallel.collectives import Collectives


def value_dtype(group: ChunkGroup, kind: str) -> torch.dtype:
    """The dtype ``kind``'s values are gathered in: fp32 for optimizer states."""
    return torch.float32 if kind in OPTIM_STATES else group.dtype


def kind_holding(
    payload: PayloadSpec, group: ChunkGroup, chunks: list[Chunk], kind: str, *, in_pieces: bool
) -> int:
    """Bytes of host memory re-packing ``kind`` of ``group`` into ``chunks`` holds at most: the
    new shards held at once (one when ``in_pieces``, else all of them) with one of them encoded
    for its slab, plus the largest old chunk read (its slab's bytes, decoded to fp32 when
    low-bit, gathered whole when sharded)."""
    itemsize = value_dtype(group, kind).itemsize
    fmt = payload.moment_format(kind)
    shards = [c.shard_size * itemsize for c in chunks]
    held = max(shards) if in_pieces else sum(shards)
    if fmt is not None:
        numel, dtype = payload.stored(kind, max(c.shard_size for c in chunks))
        held += numel * dtype.itemsize
    old_read = max(
        slab_of(c, kind).nbytes
        + (c.shard_size * 4 if fmt is not None else 0)
        + (c.capacity * itemsize if group.sharded else 0)
        for c in group.chunks
    )
    return held + old_read


def sources(group: ChunkGroup, new_chunk: Chunk) -> list[Chunk]:
    """The old chunks of ``group`` holding some of ``new_chunk``'s parameters, in old order (the
    same on every rank: slots, not shards, decide)."""
    names = {s.name for s in new_chunk.slots}
    return [old for old in group.chunks if any(s.name in names for s in old.slots)]


def gather_shard(
    group: ChunkGroup,
    new_chunk: Chunk,
    kind: str,
    fmt: MomentFormat | None,
    collectives: Collectives,
) -> torch.Tensor:
    """This rank's shard of ``new_chunk`` for one kind, filled from the old chunks it draws on
    (Adam moments stored in low precision are decoded: the new chunk's blocks are other
    blocks); every rank must call it for the same new chunks in the same order."""
    shard = torch.zeros(new_chunk.shard_size, dtype=value_dtype(group, kind))
    start, end = new_chunk.shard_range()
    new_slots = {s.name: s for s in new_chunk.slots}
    for old in sources(group, new_chunk):
        values = read_slab(slab_of(old, kind))
        if fmt is not None:
            values = fmt.decoded(values, old.shard_size)
        full = gather_chunk(old, values, collectives)
        del values
        for slot in old.slots:
            new_slot = new_slots.get(slot.name)
            if new_slot is None:
                continue
            lo, hi = max(new_slot.offset, start), min(new_slot.offset + new_slot.numel, end)
            if lo < hi:
                src = slot.offset + (lo - new_slot.offset)
                shard[lo - start : hi - start] = full[src : src + hi - lo]
    return shard


__all__ = ["gather_shard", "kind_holding", "sources", "value_dtype"]
