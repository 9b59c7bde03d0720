"""Chunk I/O: copy a slab to and from host memory, gather a sharded chunk's full values.

One place for what checkpoints (``tierwise.checkpoint.pieces``) and re-layout
(``tierwise.runtime.layout.relayout``) both do outside the training step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tierwise.chunks.master_cast import MasterCast
from tierwise.tiers.base import DONE, IOHandle

if TYPE_CHECKING:
    from tierwise.chunks.chunk import Chunk
    from tierwise.parallel.collectives import Collectives
    from tierwise.tiers.base import Slab, Tier


def read_slab(slab: Slab, numel: int | None = None) -> torch.Tensor:
    """A CPU copy of a slab's contents (its first ``numel`` elements), in the slab's dtype."""
    numel = slab.numel if numel is None else numel
    if slab.tensor is not None:
        return slab.tensor.detach()[:numel].to("cpu", copy=True)
    out = torch.empty(numel, dtype=slab.dtype)
    if numel:
        slab.tier.read(slab, out).wait()
    return out


def write_slab(slab: Slab, values: torch.Tensor) -> None:
    """Write ``values`` (converted to the slab's dtype) over the slab, waiting until done."""
    slab.tier.write(slab, values.to(slab.dtype)).wait()


MASTER_PIECE = 1 << 20
"""Elements of a master on a storage tier read at a time by ``cast_master_into`` (4 MiB of
fp32: the host memory it takes stays small whatever the chunk size)."""


def cast_master_into(
    master: Slab, out: torch.Tensor, *, offset: int = 0, into: Tier | None = None
) -> IOHandle:
    """Write ``master[offset : offset + out.numel()]`` (fp32) rounded to ``out``'s dtype into
    ``out``: the parameters of a home that holds gradients, bitwise the values it had ([Note:
    gradients in the parameter payload]). ``into``: the memory tier ``out`` is in (its
    ``cast_buffers`` hold the pieces; the device tier's memory is copied into without blocking);
    None: ``out`` is a plain host buffer. Returns the cast's handle: a master in addressable
    memory is copied at once (DONE); one on a storage tier is read a piece at a time, reads
    overlapping casts and copies, finished by ``wait`` (``progress`` moves it on): [Note:
    casting a master from storage]."""
    numel = out.numel()
    if master.tensor is not None:
        values = master.tensor[offset : offset + numel]
        out.copy_(values, non_blocking=values.is_pinned())
        return DONE
    return MasterCast(
        master,
        out,
        offset=offset,
        piece=MASTER_PIECE,
        buffers=getattr(into, "cast_buffers", None),
        to_device=into is not None and into.name == "device",
    )


def cast_master_over(master: Slab, home: Slab) -> None:
    """Rewrite ``home`` (on a storage tier) from ``master`` a piece at a time: [Note: gradients
    in the parameter payload]."""
    piece = torch.empty(min(MASTER_PIECE, home.numel), dtype=home.dtype)
    for at in range(0, home.numel, piece.numel()):
        part = piece[: min(piece.numel(), home.numel - at)]
        cast_master_into(master, part, offset=at).wait()
        home.tier.write(home, part, offset=at).wait()


def gather_chunk(chunk: Chunk, shard: torch.Tensor, collectives: Collectives) -> torch.Tensor:
    """The whole chunk's values from this rank's ``shard`` (all-gathered over the chunk's group
    when sharded, every rank calling in the same order; ``shard`` itself when not). On
    ``shard``'s device (a slab read to the host stays there: the layer moves it for the
    collective, [Note: collectives on the group's device])."""
    group = chunk.group
    if not group.sharded:
        return shard
    full = torch.empty(chunk.capacity, dtype=shard.dtype, device=shard.device)
    collectives.all_gather(full, shard, group.process_group)
    return full
