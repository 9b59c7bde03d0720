"""Page-aligned host buffers (pinned when the compute device is CUDA) for O_DIRECT I/O, each
allocated through a ledger pool ([Note: the memory ledger]): pinned ones are page-locked over
exactly their pages, not taken from PyTorch's pinned allocator ([Note: page-locked buffers])."""

from __future__ import annotations

import ctypes
import threading
import time

import torch
from tierwise.tiers.ledger import MemoryPool, locked_empty
from tierwise.units import format_bytes

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


def bounce_budget(*, limit: int, transfer_bytes: int) -> int:
    """[Note: bounce buffers in the host budget]
    The bounce buffers are host memory like any slab, so setup reserves their budget in the host
    tier ([Note: storage tiers' host buffers]) and planners count it. The largest buffer one
    transfer takes is its whole widened range (a misaligned chunk payload written back: at most
    ``transfer_bytes``, a chunk's elements at 4 bytes, plus its two partial pages), or two
    one-page bounces; each is counted with one page of alignment. So a budget of
    ``transfer_bytes`` rounded up to pages plus four pages lets every transfer run (larger ones
    wait for room, [Note: bounded bounce buffers]), and ``limit`` (NVMeOptions.bounce_bytes)
    caps it. Before, the cache's budget was 256 MiB outside every budget: a 1B LoRA run on NVMe
    homes kept 133.7 MiB of bounce buffers its host budget did not count."""
    needed = -(-transfer_bytes // ALIGNMENT) * ALIGNMENT + 4 * ALIGNMENT
    return max(2 * ALIGNMENT, min(limit, needed))


class BounceBudgetError(RuntimeError):
    """A bounce buffer would not fit the cache's byte budget."""


class _WatchedPool(MemoryPool):
    """A ledger pool that calls ``on_uncount`` after bytes were uncounted (a buffer was freed):
    a bounce cache waiting for room wakes then."""

    def __init__(self, name: str, *, on_uncount, **kwargs) -> None:
        super().__init__(name, **kwargs)
        self._on_uncount = on_uncount

    def uncount(self, nbytes: int) -> None:
        super().uncount(nbytes)
        self._on_uncount()


class BounceCache:
    """[Note: bounded bounce buffers]
    Aligned buffers for the transfers O_DIRECT cannot do in place (partial pages, misaligned or
    non-contiguous tensors, CUDA tensors' host copies), reused between transfers because fresh
    large buffers cost page faults.

    ``take(nbytes)`` returns an aligned buffer of exactly ``nbytes``: a view of a cached one of
    at most twice that size, or a new one. ``give`` returns it. Every buffer, lent or cached,
    is counted in the ledger pool ``name``, whose ``budget`` bounds them together: a new buffer
    that would pass it first drops cached ones (the largest first), then waits for lent ones to
    come back (a transfer hands its buffers back when it completes, on an I/O thread), at most
    ``timeout_s``. A single buffer larger than the budget, or a wait that runs out (every lent
    buffer belongs to transfers not yet submitted), is a ``BounceBudgetError`` naming the
    budget, never memory past it. The pool counts real memory (a buffer is uncounted when it is
    garbage), so the wait is on the pool's bytes: a buffer still referenced by a finished
    transfer's handle counts until the handle lets it go.
    """

    def __init__(
        self, name: str, *, budget: int, pinned: bool = False, timeout_s: float | None = None
    ) -> None:
        if budget < 2 * ALIGNMENT:
            raise ValueError(f"a bounce cache needs a budget of at least {2 * ALIGNMENT} bytes")
        self.pool = _WatchedPool(
            name, memory="host", pinned=pinned, budget=budget, on_uncount=self._notify
        )
        """The ledger pool of the buffers ([Note: the memory ledger])."""
        self.timeout_s = timeout_s
        self.waits = 0
        """Times a ``take`` waited for lent buffers to come back."""
        self._free: list[torch.Tensor] = []
        self._lent: dict[int, torch.Tensor] = {}  # data_ptr -> whole buffer
        self._changed = threading.Condition(threading.RLock())
        """Held while the lists change; notified when a buffer comes back or is freed."""

    @property
    def budget(self) -> int:
        return self.pool.budget

    def reserve_in_host(self, budget: int) -> None:
        """Bound the buffers by ``budget`` bytes, which the host tier counts from now on
        ([Note: bounce buffers in the host budget]); cached buffers are dropped."""
        if budget < 2 * ALIGNMENT:
            raise ValueError(f"a bounce cache needs a budget of at least {2 * ALIGNMENT} bytes")
        with self._changed:
            self._free.clear()
            self.pool.budget = budget
            self.pool.within = "host"

    def take(self, nbytes: int) -> torch.Tensor:
        counted = nbytes + ALIGNMENT  # what the pool counts for an aligned buffer
        if counted > self.budget:
            raise BounceBudgetError(
                f"nvme tier: a transfer needs a bounce buffer of {format_bytes(nbytes)}, over "
                f"the bounce buffers' budget of {format_bytes(self.budget)}; raise "
                "TIERWISE_NVME_BOUNCE_BYTES (or use smaller chunks)"
            )
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        with self._changed:
            while True:
                fits = [i for i, b in enumerate(self._free) if nbytes <= b.numel() <= 2 * nbytes]
                if fits:
                    whole = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
                    break
                while self._free and self.pool.bytes + counted > self.budget:
                    self._free.pop()  # the largest; uncounted as it is garbage
                if self.pool.bytes + counted <= self.budget:
                    whole = self._new(nbytes)
                    break
                self.waits += 1
                left = None if deadline is None else deadline - time.monotonic()
                if (left is not None and left <= 0) or not self._changed.wait(left):
                    raise BounceBudgetError(
                        f"nvme tier: no room for a bounce buffer of {format_bytes(nbytes)} "
                        f"within {self.timeout_s:g} s: transfers hold "
                        f"{format_bytes(self.pool.bytes)} of the bounce buffers' budget of "
                        f"{format_bytes(self.budget)}; raise TIERWISE_NVME_BOUNCE_BYTES"
                    )
            self._lent[whole.data_ptr()] = whole
        return whole[:nbytes]

    def _new(self, nbytes: int) -> torch.Tensor:
        return aligned_empty(nbytes, pool=self.pool)

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def give(self, buffer: torch.Tensor) -> None:
        with self._changed:
            self._free.append(self._lent.pop(buffer.data_ptr()))
            self._free.sort(key=torch.Tensor.numel)
            self._changed.notify_all()

    def cached_bytes(self) -> int:
        """Bytes of the buffers kept for reuse (not lent)."""
        with self._changed:
            return sum(b.numel() for b in self._free)


__all__ = [
    "BounceBudgetError",
    "BounceCache",
    "aligned_empty",
    "bounce_budget",
    "byte_view",
    "is_aligned",
    "memoryview_of",
]
