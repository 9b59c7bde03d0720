"""What the activation swaps record: one storage a swapped block saved (``StoredStorage``), one
saved tensor packed as a view of it (``PackedTensor``), a step's swap figures (``SwapCounts``), and
the page arithmetic of nvme slabs ([Note: swap writes from the saved storage] in ``swaps``)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from tierwise.runtime.activations.pinned_pool import ALIGNMENT


@dataclass(eq=False)
class StoredStorage:
    """One storage a swapped block saved, wherever its bytes are now."""

    block: str
    target: str
    nbytes: int
    source: torch.Tensor | None = None
    """uint8 view of the original storage, held until its copy has landed."""
    host: torch.Tensor | None = None
    """The host copy (host target; CUDA nvme staging)."""
    slab: Any = None
    """The nvme tier slab (nvme target)."""
    lead: int = 0
    """Byte offset of the data in its slab: [Note: swap writes from the saved storage]."""
    write: Any = None
    """IOHandle or CUDA event of the swap-out in flight."""
    read: Any = None
    """IOHandle or CUDA event of the swap-in in flight."""
    on_disk: bool = False
    """CUDA nvme swap-in: ``read`` is the disk read into ``host``; the copy to the device is
    issued once it lands ([Note: storage reads into device memory])."""
    loaded: torch.Tensor | None = None
    """uint8 bytes on the compute device after swap-in."""
    users: int = 0
    """Saved tensors packed from it that are still to be unpacked."""


@dataclass(frozen=True, eq=False)
class PackedTensor:
    """A saved tensor as autograd holds it while its storage is swapped: the view to rebuild."""

    stored: StoredStorage
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass
class SwapCounts:
    """The swaps of one step."""

    swapped_out: Counter = field(default_factory=Counter)
    """Bytes swapped out, per target ("host", "nvme")."""
    swapped_in: Counter = field(default_factory=Counter)
    """Bytes swapped in, per target."""
    unpinned_bytes: int = 0
    """CUDA: bytes swapped through unpinned host buffers because the pinned pool was full."""
    io_wait_s: float = 0.0
    """Seconds the step stood still waiting for swap I/O to land (the part not hidden)."""


def bytes_of(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over all of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def whole_pages(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pages."""
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def page_lead(source: torch.Tensor) -> int:
    """Where a storage's bytes start in its nvme slab: its address modulo the page, so the
    tier moves its whole pages in place ([Note: swap writes from the saved storage]). 0 for an
    address off the allocator's 64-byte grid (the tier then bounces the whole range), which keeps
    the swapped-in copy's offset a multiple of every element size."""
    address = source.data_ptr()
    return address % ALIGNMENT if address % 64 == 0 else 0


def with_block(err: BaseException, block: str, doing: str) -> BaseException:
    """``err`` with a note naming the block whose activations were being moved."""
    if hasattr(err, "add_note"):
        err.add_note(f"tierwise: while {doing} the activations of block {block}")
    return err


__all__ = [
    "PackedTensor",
    "StoredStorage",
    "SwapCounts",
    "bytes_of",
    "page_lead",
    "whole_pages",
    "with_block",
]
