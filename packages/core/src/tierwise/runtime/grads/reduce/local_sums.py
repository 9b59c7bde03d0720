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
gradients land per due point]).

The device memory the upload lands in is bounded by what the plan already counts: a second
block of the reducer's pool, beside the one holding the chunk's staging (``full``). It is taken
as a reduction takes one ([Note: bounded gradient blocks]): a free block, else the oldest
reduction in flight is waited for (on CUDA ``work.wait()`` makes the engine thread's stream wait
for NCCL's, no host wait; gloo on a CPU waits on the host, as any launch does), else a waiting
chunk's block is spilled to the host. The sum is uploaded into it, added into ``full``, and the
block goes back to the pool at once: the copy and the addition are queued on the engine
thread's stream, and whatever writes the block next is queued after them on that stream (a
collective on it first waits for that stream), as for a spilled block. So with the plan's
``REDUCTION_BLOCKS`` (2) blocks, at most 2 blocks of the largest reduced chunk (the pool's
``block_numel``: every chunk's sum fits, a parameter larger than ``chunk_size`` in its own
chunk included) hold gradients, reductions and uploads together, plus the receive block with
``reduce_order="rank"``: ``planner.reduction_blocks``, which both planners count (core's
``staging_bytes``, the search's ``staging_blocks``). The ledger's ``gradient_reduction_blocks``
counts the blocks in use against that figure and refuses one more. ``stats()["no_sync"]`` says
how many sums were uploaded into a block and names the pool.

A pool of one block (below the plan; test rigs build one to make every block taken) has no
second block: the sum is added in host memory instead, the chunk's staging copied into a host
buffer of the reducer's pool, landed (one host wait for that chunk), the sum added there and
the result uploaded back over ``full`` (``host_additions`` in ``stats()["no_sync"]``). A host
budget without room for the sums fails the backward with the host tier's error and what to
change: ``Config.accumulation_steps`` accumulates into the rank's own gradient shards (a
reduction per micro-batch, no whole-chunk buffers), or a larger ``host_memory``.
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
    from tierwise.runtime.grads.reduce.blocks import BlockPool


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
        self.uploads = 0
        """Sums uploaded into a reduction block and added on the device."""
        self.host_additions = 0
        """Sums added through host memory: a pool of one block, below the plan (``_add_on_host``)."""

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
        pool: BlockPool,
        device_block: Callable[[], torch.Tensor],
    ) -> None:
        """``full`` (a chunk's staging in a block of ``pool``) += ``key``'s sum, if it has one:
        uploaded without blocking into a second block (``device_block``, the reducer's: a
        free block, the oldest reduction waited for, or a waiting chunk spilled), added, and
        that block given back; the sum kept, and its host bytes reserved, until the copy lands
        ([Note: no_sync buffers]). A pool of one block: added on the host."""
        local = self._sums.pop(key, None)
        if local is None:
            return
        if pool.blocks < 2:
            self._add_on_host(full, local, writes)
            return
        block = device_block()
        target = block[: full.numel()]
        full.add_(writes.upload(target, local, then=lambda: self.release(local)))
        pool.give(block)  # whatever writes it next is queued after the addition
        self.uploads += 1

    def _add_on_host(self, full: torch.Tensor, local: torch.Tensor, writes: HostWrites) -> None:
        """No device memory for the upload: ``full`` is copied into a host buffer of the
        reducer's pool, landed (one host wait), the sum added there (the same addition of the
        same values) and uploaded back over ``full``."""
        self.host_additions += 1
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

    def stats(self) -> dict:
        """``stats()["no_sync"]``: the sums' host bytes now and where their uploads went."""
        return {
            "sum_bytes": self.nbytes,
            "uploads": self.uploads,
            "upload_pool": "gradient_reduction_blocks",
            "host_additions": self.host_additions,
        }

    @property
    def nbytes(self) -> int:
        """Bytes the sums hold now."""
        return sum(b.numel() * b.element_size() for b in self._sums.values())


__all__ = ["NoSyncSums"]
