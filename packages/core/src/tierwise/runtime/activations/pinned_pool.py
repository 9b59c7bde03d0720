"""HostBufferPool: a bounded pool of reusable, page-aligned host buffers (pinned on CUDA).

[Note: bounded pinned buffers]
Copies between a CUDA device and host memory only run asynchronously when the host side is
pinned, and pinned memory is scarce (it cannot be paged out). The activation manager takes its
host buffers from one pool with a fixed byte budget (``capacity``): the bytes of all buffers the
pool holds, lent or free, never exceed it.

- ``take(nbytes)`` lends a buffer of exactly ``nbytes`` (a view of a pooled one): a free buffer
  of at most twice that size is reused; otherwise a new one is allocated once free buffers were
  dropped (largest first) to make room. When the lent buffers fill the budget, the pool waits for
  the oldest buffer whose return is pending (``give(..., after=handle)``: the copy or write
  reading it is still in flight) and recycles it; it only waits on transfers already started, so
  it cannot wait forever. When nothing is pending and still nothing fits, or ``nbytes`` alone
  exceeds the budget, ``take`` returns None and counts the refusal: the caller then uses an
  unpinned buffer (on CUDA its copies block the host thread, see the activation stats'
  ``host_buffers``), so memory never grows past the budget and no swap is refused.
- ``give(buffer, after=handle)``: the buffer is reusable once ``handle`` has completed (None:
  now). ``handle`` is a CUDA event or an I/O handle (``tierwise.tiers.IOHandle``), the two
  kinds of transfer the activation manager waits for (``transfer_done``/``wait_for_transfer``),
  so the pool's logic is the same on every device (tests run it on CPU with pinning off and
  I/O handles).

Buffers are allocated through the ledger pool ``memory`` ("activation_host_buffers", counted in
the host tier: [Note: the memory ledger]): pinned ones are page-locked over exactly their pages,
whole pinned buffers are rounded up to a page (``ALIGNMENT``) and the pool counts them so; a dropped
buffer is unlocked and freed, not kept by PyTorch's caching host allocator ([Note: page-locked
buffers]).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from tierwise.plan import swap_target
from tierwise.tiers.arena import round_up
from tierwise.tiers.ledger import MemoryPool

ALIGNMENT = 4096
"""Host buffers start on a page boundary (O_DIRECT transfers need it)."""
PINNED_POOL_BYTES = 1 << 30
"""Default budget of the activation manager's pinned host buffers on CUDA, bytes (1 GiB)."""


def pinned_swap_bytes(config, policy: dict[str, str]) -> int:
    """Bytes of pinned host buffers the activation manager may hold (``Config.pinned_memory``,
    default ``PINNED_POOL_BYTES``): on CUDA when some block swaps to host or nvme, else 0. Setup
    reserves them in the host tier, so ``host_memory`` counts them."""
    if torch.device(config.device).type != "cuda":
        return 0
    if not any(swap_target(action) for action in policy.values()):
        return 0
    return PINNED_POOL_BYTES if config.pinned_memory is None else config.pinned_memory


def aligned_empty(nbytes: int, *, alignment: int = ALIGNMENT) -> torch.Tensor:
    """An uninitialised, pageable uint8 CPU tensor of ``nbytes`` whose first byte is
    ``alignment``-aligned (one page more is allocated and sliced)."""
    raw = torch.empty(nbytes + alignment, dtype=torch.uint8)
    skip = -raw.data_ptr() % alignment
    return raw[skip : skip + nbytes]


def transfer_done(handle: Any) -> bool:
    """True when a transfer (a CUDA event or an ``IOHandle``) has completed."""
    return handle.query() if isinstance(handle, torch.cuda.Event) else handle.done()


def wait_for_transfer(handle: Any) -> None:
    """Block until a transfer (a CUDA event or an ``IOHandle``) has completed; an I/O handle
    re-raises its error."""
    if isinstance(handle, torch.cuda.Event):
        handle.synchronize()
    else:
        handle.wait()


@dataclass
class PoolStats:
    """Counters of a ``HostBufferPool`` (cumulative, except ``held_bytes``/``lent_bytes``)."""

    capacity_bytes: int
    held_bytes: int = 0
    """Bytes of the buffers the pool holds now (lent, pending return, free)."""
    lent_bytes: int = 0
    """Bytes lent now (including returns still pending)."""
    high_water_bytes: int = 0
    """Most bytes the pool held at once."""
    waits: int = 0
    """Times ``take`` waited for a pending return to recycle its buffer."""
    refused: int = 0
    """Times ``take`` returned None (budget exhausted, or one request larger than the budget)."""
    refused_bytes: int = 0


class HostBufferPool:
    """See [Note: bounded pinned buffers]."""

    def __init__(self, capacity: int, *, pin: bool) -> None:
        if capacity < 0:
            raise ValueError(f"a host buffer pool needs a budget >= 0 bytes, got {capacity}")
        self.capacity, self.pin = capacity, pin
        self.memory = MemoryPool(
            "activation_host_buffers",
            memory="host",
            pinned=pin,
            budget=capacity if pin else None,  # unpinned: each buffer has a page of slack
            within="host",
        )
        """The ledger pool the buffers are allocated through ([Note: the memory ledger])."""
        self._free: list[torch.Tensor] = []  # whole buffers, smallest first
        self._lent: dict[int, torch.Tensor] = {}  # data_ptr of the lent view -> whole buffer
        self._pending: deque[tuple[torch.Tensor, Any]] = deque()  # (whole, handle), oldest first
        self.counters = PoolStats(capacity_bytes=capacity)

    # -- lending ------------------------------------------------------------------------
    def take(self, nbytes: int) -> torch.Tensor | None:
        """A buffer of ``nbytes`` from the pool, or None (counted) when it cannot have one."""
        if nbytes > self.capacity:
            return self._refuse(nbytes)
        while True:
            self._collect()
            whole = self._reuse(nbytes)
            if whole is None:
                whole = self._allocate(nbytes)
            if whole is not None:
                view = whole[:nbytes]
                self._lent[view.data_ptr()] = whole
                self.counters.lent_bytes += whole.numel()
                return view
            if not self._pending:
                return self._refuse(nbytes)
            oldest, handle = self._pending.popleft()
            self.counters.waits += 1
            self._quietly_wait(handle)
            self._free_buffer(oldest)

    def owns(self, buffer: torch.Tensor) -> bool:
        """True when ``buffer`` was lent by this pool and not given back yet."""
        return buffer.data_ptr() in self._lent

    def give(self, buffer: torch.Tensor, *, after: Any = None) -> None:
        """Return a lent buffer; it is reused once ``after`` (a transfer reading or filling it)
        has completed."""
        whole = self._lent.pop(buffer.data_ptr())
        if after is None or transfer_done(after):
            self._free_buffer(whole)
        else:
            self._pending.append((whole, after))

    def close(self) -> None:
        """Wait for pending returns and drop every buffer (lent ones stay the borrowers')."""
        while self._pending:
            whole, handle = self._pending.popleft()
            self._quietly_wait(handle)
            self.counters.lent_bytes -= whole.numel()
            self.counters.held_bytes -= whole.numel()
        for whole in self._free:
            self.counters.held_bytes -= whole.numel()
        self._free.clear()

    def stats(self) -> dict[str, int]:
        return dict(vars(self.counters))

    # -- internals ----------------------------------------------------------------------
    def _collect(self) -> None:
        """Buffers whose pending transfer completed become free."""
        still = deque()
        for whole, handle in self._pending:
            if transfer_done(handle):
                self._free_buffer(whole)
            else:
                still.append((whole, handle))
        self._pending = still

    def _free_buffer(self, whole: torch.Tensor) -> None:
        self.counters.lent_bytes -= whole.numel()
        self._free.append(whole)
        self._free.sort(key=torch.Tensor.numel)

    def _reuse(self, nbytes: int) -> torch.Tensor | None:
        for index, whole in enumerate(self._free):  # smallest first: the tightest fit
            if nbytes <= whole.numel() <= 2 * nbytes:
                return self._free.pop(index)
        return None

    def _allocate(self, nbytes: int) -> torch.Tensor | None:
        if self.pin:  # whole pages, as they are locked and counted
            nbytes = round_up(nbytes, ALIGNMENT)
        while self._free and self.counters.held_bytes + nbytes > self.capacity:
            # the largest, unreferenced before the new one is allocated
            self.counters.held_bytes -= self._free.pop().numel()
        if self.counters.held_bytes + nbytes > self.capacity:
            return None
        whole = self.memory.empty(nbytes, aligned=True)
        self.counters.held_bytes += nbytes
        self.counters.high_water_bytes = max(
            self.counters.high_water_bytes, self.counters.held_bytes
        )
        return whole

    def _quietly_wait(self, handle: Any) -> None:
        try:
            wait_for_transfer(handle)
        except Exception:  # the transfer's owner reports its error; the buffer is free either way
            pass

    def _refuse(self, nbytes: int) -> None:
        self.counters.refused += 1
        self.counters.refused_bytes += nbytes
        return None


__all__ = [
    "ALIGNMENT",
    "PINNED_POOL_BYTES",
    "HostBufferPool",
    "PoolStats",
    "aligned_empty",
    "pinned_swap_bytes",
    "transfer_done",
    "wait_for_transfer",
]
