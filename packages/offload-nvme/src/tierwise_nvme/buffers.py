"""Page-aligned host buffers (pinned when the compute device is CUDA) for O_DIRECT I/O, each
allocated through a ledger pool ([Note: the memory ledger]): pinned ones are page-locked over
exactly their pages, not taken from PyTorch's pinned allocator ([Note: page-locked buffers])."""

from __future__ import annotations

import ctypes
import threading

import torch
from tierwise.tiers.ledger import MemoryPool, locked_empty

from tierwise_nvme.options import ALIGNMENT  # one page: what ledger pools align to


def aligned_empty(
    nbytes: int, *, pin: bool = False, pool: MemoryPool | None = None
) -> torch.Tensor:
    """A uint8 CPU tensor of ``nbytes`` whose first byte is ALIGNMENT-aligned, counted in
    ``pool`` (None: counted nowhere, for probes) until it is garbage.

    Over-allocates by one alignment unit and slices; pinned: page-locked over its own pages.
    """
    if pool is not None:
        return pool.empty(nbytes, aligned=True)
    if pin:
        return locked_empty(nbytes)
    raw = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8)
    skip = -raw.data_ptr() % ALIGNMENT
    return raw[skip : skip + nbytes]


def is_aligned(tensor: torch.Tensor) -> bool:
    """True when ``tensor``'s memory starts on an ALIGNMENT boundary."""
    return tensor.data_ptr() % ALIGNMENT == 0


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 tensor sharing its memory."""
    flat = tensor.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def memoryview_of(byte_tensor: torch.Tensor) -> memoryview:
    """A writable memoryview of a flat uint8 CPU tensor (what the I/O backends take).

    Built from the address, not ``tensor.numpy()``: sharing with numpy would make the tensor's
    storage non-resizable, and the engine frees cached chunks by resizing their storage. The
    caller keeps the tensor alive (and its storage unresized) until the transfer completes.
    """
    array = (ctypes.c_char * byte_tensor.numel()).from_address(byte_tensor.data_ptr())
    return memoryview(array).cast("B")


class BounceCache:
    """Reuses aligned buffers between transfers (fresh large buffers cost page faults).

    ``take(nbytes)`` returns an aligned buffer of exactly ``nbytes``: a view of a cached one of
    at most twice that size, or a new one. ``give`` returns it; at most ``limit`` bytes stay
    cached (the largest are dropped first). Every buffer, lent or cached, is counted in
    ``pool`` (its size is set by the transfers at run time, so the pool has no byte budget;
    ``limit`` bounds what it keeps between transfers).
    """

    def __init__(self, *, limit: int, pool: MemoryPool) -> None:
        self.limit = limit
        self.pool = pool
        self._free: list[torch.Tensor] = []
        self._lent: dict[int, torch.Tensor] = {}  # data_ptr -> whole buffer
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if nbytes <= b.numel() <= 2 * nbytes]
            best = min(fits, key=lambda i: self._free[i].numel()) if fits else None
            whole = self._free.pop(best) if best is not None else None
        if whole is None:
            whole = aligned_empty(nbytes, pool=self.pool)
        with self._lock:
            self._lent[whole.data_ptr()] = whole
        return whole[:nbytes]

    def give(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._free.append(self._lent.pop(buffer.data_ptr()))
            self._free.sort(key=torch.Tensor.numel)
            while sum(b.numel() for b in self._free) > self.limit:
                self._free.pop()  # the largest


__all__ = ["BounceCache", "aligned_empty", "byte_view", "is_aligned", "memoryview_of"]
