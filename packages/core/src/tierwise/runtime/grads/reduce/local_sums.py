"""The whole-chunk gradient sums ``no_sync`` keeps on each rank, counted in the host tier.

[Note: no_sync buffers]
Under ``tierwise.no_sync`` with several ranks nothing is communicated, so each rank keeps the
unreduced gradients of every chunk a backward reaches: a whole chunk (not a shard) in the
compute precision, as DDP keeps every parameter's whole ``.grad``. They are added to the
chunk's staging when it is next reduced (the first backward outside ``no_sync``), so the sum is
DDP's: this rank's micro-batches added in order, then averaged across ranks. These buffers are
host memory like any slab: each is reserved in the host tier when made (kind STAGING, "no_sync
gradient sums") and given back when its chunk is reduced or at zero_grad, so ``host_memory``
bounds them and ``stats()`` shows them in the host tier's bytes and peak. On CUDA they are
page-locked ([Note: page-locked buffers]), so the upload at the launch (``add_into``) is queued
without blocking; the sum is kept, and its bytes reserved, until that copy lands ([Note: reduced
gradients land per due point]). The device memory the upload lands in (it is added to the
chunk's staging there) is a free reduction block, or, when every block is taken, a whole chunk
reserved in the device tier: counted in ``device_memory`` and ``stats()``, held until the copy
lands. A device budget without room for it (the planner does not count it) falls back to
adding on the host: the chunk's staging is copied into a host buffer of the reducer's pool,
landed (one host wait for that chunk), the sum added there and the result uploaded back, with
no device memory beyond the staging (``NoSyncSums.fallbacks`` counts it). A host budget without
room
fails the backward with the host tier's error and what to change: ``Config.accumulation_steps``
accumulates into the rank's own gradient shards (a reduction per micro-batch, no whole-chunk
buffers), or a larger ``host_memory``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

import torch

from tierwise.chunks import Chunk
from tierwise.tiers.base import PayloadKind, Tier, TierBudgetError
from tierwise.tiers.ledger import locked_empty

if TYPE_CHECKING:
    from tierwise.runtime.grads.host_writes import HostWrites


class NoSyncSums:
    """Chunk key -> the rank's unreduced gradient sum under ``no_sync`` ([Note: no_sync
    buffers])."""

    def __init__(self, host: Tier | None, dtype: torch.dtype) -> None:
        self.host = host
        """The host tier the sums are counted in (None: uncounted, a tier-less test rig)."""
        self.dtype = dtype
        self.pinned = bool(getattr(host, "pin", False))
        """Whether the sums are page-locked (the host tier's memory is, on CUDA)."""
        self._sums: dict[Hashable, torch.Tensor] = {}
        self.fallbacks = 0
        """Sums added through host memory for want of device memory (``_add_on_host``)."""

    def buffer(self, chunk: Chunk) -> torch.Tensor:
        """``chunk``'s sum (zeros when it has none yet): reserved in the host tier first."""
        if chunk.key not in self._sums:
            nbytes = chunk.capacity * self.dtype.itemsize
            if self.host is not None:
                try:
                    self.host.reserve(
                        nbytes, kind=PayloadKind.STAGING, what="no_sync gradient sums"
                    )
                except TierBudgetError as err:
                    err.add_note(
                        f"tierwise: no_sync with {chunk.group.world} ranks keeps a whole "
                        f"unreduced chunk of gradients per chunk on each rank ({nbytes} bytes "
                        f"for chunk {chunk.group.name}#{chunk.index}); use "
                        "Config.accumulation_steps instead (gradients are reduced into each "
                        "rank's shard every micro-batch) or raise host_memory"
                    )
                    raise
            if self.pinned:
                self._sums[chunk.key] = locked_empty(nbytes, self.dtype).zero_()
            else:
                self._sums[chunk.key] = torch.zeros(chunk.capacity, dtype=self.dtype)
        return self._sums[chunk.key]

    def add_into(
        self,
        full: torch.Tensor,
        key: Hashable,
        writes: HostWrites,
        upload_target: Callable[[int, str], tuple[torch.Tensor, Callable[[], None]]],
    ) -> None:
        """``full`` (a chunk's staging on the device) += ``key``'s sum, if it has one: uploaded
        without blocking into device memory from ``upload_target`` (the reducer's
        ``BlockPool.upload_target``: a free block, or bytes reserved in the device tier), the
        sum kept and its host bytes reserved, and the device memory held, until the copy
        lands."""
        local = self._sums.pop(key, None)
        if local is None:
            return
        try:
            on_device, give_back = upload_target(full.numel(), "a no_sync gradient sum's upload")
        except TierBudgetError:
            self._add_on_host(full, local, writes)
            return

        def landed() -> None:
            self.release(local)
            give_back()

        full.add_(writes.upload(on_device, local, then=landed))

    def _add_on_host(self, full: torch.Tensor, local: torch.Tensor, writes: HostWrites) -> None:
        """No device memory for the upload: ``full`` is copied into a host buffer of the
        reducer's pool, landed (one host wait), the sum added there (the same addition of the
        same values) and uploaded back over ``full``."""
        self.fallbacks += 1
        staged = writes.scratch(full.numel())
        writes.copy(staged, full, on_host=True)
        writes.land()
        staged.add_(local)

        def landed() -> None:
            self.release(local)
            writes.give_back(staged)

        writes.upload(full, staged, then=landed)

    def release(self, buffer: torch.Tensor) -> None:
        """A sum was used (or dropped): its bytes go back to the host tier."""
        if self.host is not None:
            self.host.unreserve(buffer.numel() * buffer.element_size())

    def drop(self) -> None:
        """zero_grad: every sum is dropped."""
        for buffer in self._sums.values():
            self.release(buffer)
        self._sums.clear()

    @property
    def nbytes(self) -> int:
        """Bytes the sums hold now."""
        return sum(b.numel() * b.element_size() for b in self._sums.values())


__all__ = ["NoSyncSums"]
