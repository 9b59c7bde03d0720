"""PinnedArena: the host tier's page-locked memory on CUDA, registered with the driver once.

[Note: one pinned arena]
Page-locking is slow (the driver walks and locks every page) and scarce, and many small locked
regions fragment it. The host tier on CUDA therefore keeps its slabs in one arena: one run of
ordinary page-aligned memory registered with ``cudaHostRegister`` once, sliced into slabs by a
first-fit allocator (slab offsets ``SLAB_ALIGNMENT``-aligned; a released slab's room is merged
with its free neighbours and reused by later slabs).

- Sizing: setup tells the tier every slab it is about to allocate (``Tier.check_capacity``), and
  the arena is made that size, so after setup it is full and nothing in it is idle.
- Growth: an allocation that does not fit (a re-layout that fragments it, the first accumulated
  gradient, a tier used without ``check_capacity``) registers one more extent of exactly the
  slab's pages, counted before it is locked: over the budget it is refused (``TierBudgetError``)
  and nothing is registered. Growing by more (the arena's size so far, say) would lock and count
  room nothing asked for: with a budget smaller than twice the arena every later ``reserve``
  (undo copies, save buffers) would then fail although the budget had room (issue 36).
- Counting: the host tier counts each extent whole, when it is registered, against
  ``host_memory`` (``Tier._account``), so what is locked and what is counted are the same bytes;
  slabs carved from it count nothing more, and a released slab's room stays counted (it is still
  locked) until the tier is closed.
- Extents are unregistered when the tier closes (or is garbage-collected).
"""

from __future__ import annotations

import weakref
from bisect import insort
from dataclasses import dataclass, field

import torch

PAGE = 4096
"""Bytes: registered extents start on a page and cover whole pages."""
SLAB_ALIGNMENT = 64
"""Bytes: every slab in the arena starts on this boundary (any dtype, vectorised kernels)."""


def round_up(nbytes: int, multiple: int) -> int:
    return -(-nbytes // multiple) * multiple


def check_cuda(call: str, status) -> None:
    code = int(getattr(status, "value", status))
    if code != 0:
        raise RuntimeError(
            f"tierwise: {call} failed with CUDA error {code} while page-locking the host tier's "
            "arena ([Note: one pinned arena]); the machine may limit locked memory (ulimit -l), "
            "or lower host_memory"
        )


def _unregister(addresses: list[int]) -> None:
    while addresses:
        check_cuda("cudaHostUnregister", torch.cuda.cudart().cudaHostUnregister(addresses.pop()))


@dataclass
class _Extent:
    region: torch.Tensor
    """uint8 view of the registered pages (its storage keeps the memory alive)."""
    free: list[tuple[int, int]] = field(default_factory=list)
    """(offset, nbytes) runs not lent, sorted by offset, never adjacent."""


class PinnedArena:
    """See [Note: one pinned arena]."""

    def __init__(self) -> None:
        self.extents: list[_Extent] = []
        self.registered_bytes = 0
        self._addresses: list[int] = []
        self._finalizer = weakref.finalize(self, _unregister, self._addresses)

    @property
    def registrations(self) -> int:
        return len(self.extents)

    @staticmethod
    def extent_bytes(nbytes: int) -> int:
        """Bytes of the extent to register for a request of ``nbytes`` (already aligned): its
        whole pages, no more ([Note: one pinned arena])."""
        return round_up(nbytes, PAGE)

    def grow(self, nbytes: int) -> None:
        """Register one more extent of ``nbytes`` (whole pages) of page-aligned memory."""
        raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
        skip = -raw.data_ptr() % PAGE
        region = raw[skip : skip + nbytes]
        check_cuda(
            "cudaHostRegister", torch.cuda.cudart().cudaHostRegister(region.data_ptr(), nbytes, 0)
        )
        self._addresses.append(region.data_ptr())
        self.extents.append(_Extent(region, [(0, nbytes)]))
        self.registered_bytes += nbytes

    def take(self, nbytes: int) -> tuple[int, int] | None:
        """(extent index, offset) of a free run of ``nbytes`` (aligned), or None."""
        for index, extent in enumerate(self.extents):
            for position, (offset, size) in enumerate(extent.free):
                if size >= nbytes:
                    if size == nbytes:
                        del extent.free[position]
                    else:
                        extent.free[position] = (offset + nbytes, size - nbytes)
                    return index, offset
        return None

    def view(self, index: int, offset: int, nbytes: int) -> torch.Tensor:
        return self.extents[index].region[offset : offset + nbytes]

    def give(self, index: int, offset: int, nbytes: int) -> None:
        """A lent run is free again (merged with free neighbours)."""
        free = self.extents[index].free
        insort(free, (offset, nbytes))
        merged: list[tuple[int, int]] = []
        for run in free:
            if merged and merged[-1][0] + merged[-1][1] == run[0]:
                merged[-1] = (merged[-1][0], merged[-1][1] + run[1])
            else:
                merged.append(run)
        free[:] = merged

    def close(self) -> None:
        """Unregister every extent (slabs still referenced stay valid, no longer locked)."""
        self._finalizer()


__all__ = ["PAGE", "SLAB_ALIGNMENT", "PinnedArena", "check_cuda", "round_up"]
