"""Gradient shards of chunks whose optimizer states are on a storage tier (NVMe): a few host
buffers in front of the shards' home on that tier ([Note: active gradient offloading]).
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from typing import TYPE_CHECKING

import torch

from tierwise.chunks.payload import (
    GRAD_OFFLOAD_BUFFERS,
    grad_offload_buffers,
    grad_offload_bytes,
)
from tierwise.parallel.timeouts import wait_timeout_s, wait_until
from tierwise.tiers.base import PayloadKind
from tierwise.tiers.ledger import MemoryPool

if TYPE_CHECKING:
    from tierwise.chunks import Chunk
    from tierwise.tiers.base import Tier

# [Note: active gradient offloading]
# With the optimizer states on NVMe, a chunk's gradient shard has its home on NVMe too (one
# region, ``PayloadKind.GRAD_SHARD``), and host memory holds at most GRAD_OFFLOAD_BUFFERS shards
# at a time (LoHan's active gradient offloading): host memory for gradients does not grow with
# the model. A shard is in one of four places:
# - nowhere (no gradient since zero_grad: its gradient state EMPTY, [Note: gradient lifecycle]);
# - a host buffer (``OptimSlabs.grad_buffer``): backward accumulates into it exactly as into a
#   host shard ([Note: first gradient is a copy] included), so every value is bitwise the same;
# - its NVMe region: a buffer was needed for another chunk, so the least recently used shard
#   that no update is reading was written out ("spilled"; complete or half-filled), and it is
#   read back before anything adds to it or reads it (accumulation, clipping, the update);
# - consumed (the update ran and gave the buffer back: gradient state UPDATED with no buffer,
#   then CONSUMED once the step commits): its optimizer update has read it. With in-backward updates (the steady state without clipping or accumulation) a
#   chunk's update is queued as soon as its gradients are complete and consumes the buffer, so
#   gradients never touch the disk; after-backward updates spill what does not fit and read it
#   back at ``step``.
# With the gradients in an NVMe parameter payload ([Note: gradients in the parameter payload])
# the shard's region is the home's: a spill writes gradients over the parameters, which
# ``zero_grad`` rewrites from the master.
# A device home holding the gradients of a chunk whose states are on NVMe ([Note: gradients
# staged from a device home]) borrows a buffer only while its update is queued: ``stage``.
# A buffer lent to a queued update is pinned until the pipeline reports the job done (updated,
# or dropped after a failure): a buffer request waits for such a release before it spills, and
# spills only when nothing is pinned. Spills and read-backs wait for their I/O on the calling
# thread, so a failed write surfaces there: in backward it ends the backward ([Note: an
# abandoned backward]); in ``step`` before anything is committed ([Note: atomic optimizer step]).


# [Note: gradients staged from a device home]
# A sharded bf16/fp16 device home whose optimizer states are on NVMe, or in host memory, keeps
# its gradients in the home ([Note: gradients in the parameter payload]): 14 bytes of model data
# per element. A worker thread (the NVMe pipeline's, or the host worker of [Note: host updates
# in backward]) must not read device memory ([Note: CUDA threading model]), so when such an
# update is built for a worker (``GradStorage.lend``: on an engine thread, in backward or at
# ``step``) the engine's thread takes one of the host buffers in front of the pipeline, copies
# the home into it (the device tier's read: a non-blocking copy into page-locked memory and its
# event) and waits for that event, once per chunk ([Note: one host wait per chunk]), before the
# job is queued; the worker reads the buffer only. The buffer is lent, never held (``stage``),
# so it is never spilled. NVMe states: until the update the gradients stay in the device home,
# which a redo after a rollback copies again. Host states: the host worker's update writes new
# parameters over the home, so its undo record clones the staged buffer (on the worker: host
# memory) and a rollback copies that clone back into the home on the engine's thread. Host
# states updated after backward run on the engine's thread and read the home directly (nothing
# staged). The update's new values go back through ``HomeWrites`` as for any device home; the
# home holds gradients, not parameters, until then, so loads cast the committed master ([Note:
# gradients in the parameter payload]).


class GradientOffload:
    """See [Note: active gradient offloading]. Owned by the engine; the optimizer pipeline's
    worker thread calls ``consumed`` (host buffers only: [Note: CUDA threading model])."""

    def __init__(
        self,
        *,
        host: Tier,
        numel: int,
        dtype: torch.dtype,
        count: int,
        timeout_s: float | None = None,
    ) -> None:
        if count < 1:
            raise ValueError(f"gradient offload needs at least 1 host buffer, got {count}")
        self.host = host
        self.numel = numel
        self.dtype = dtype
        self.count = count
        self._pin = host.device.type == "cuda"
        self.nbytes = grad_offload_bytes(count, numel * dtype.itemsize, pinned=self._pin)
        """Host bytes the buffers take (page-locked ones in whole pages), counted in the host
        tier and the budget of their ledger pool."""
        host.reserve(self.nbytes, kind=PayloadKind.GRAD_SHARD, what="gradient offload buffers")
        self.memory = MemoryPool(
            "grad_offload_buffers",
            memory="host",
            pinned=self._pin,
            budget=self.nbytes,
            within="host",
        )
        """The ledger pool the buffers are allocated through ([Note: the memory ledger])."""
        self._free: list[torch.Tensor] = []
        self._made = 0
        self._lru: OrderedDict[Chunk, None] = OrderedDict()
        """Chunks holding a buffer that no update reads, least recently used first."""
        self._pinned = 0
        self._on_disk: dict[Chunk, object] = {}
        """Chunks whose shard is being (an IOHandle) or was (True, or the OSError) written to
        disk before a speculative update consumes it ([Note: speculative updates])."""
        self._over_home: set[Chunk] = set()
        """Chunks keeping their gradients in an NVMe home whose region a spill wrote gradients
        over since zero_grad ([Note: gradients in the parameter payload])."""
        self._cond = threading.Condition()
        self.timeout_s = wait_timeout_s() if timeout_s is None else timeout_s
        """Seconds a buffer request waits for an update to give one back ([Note: bounded
        waits])."""
        self.moved_bytes: Counter[str] = Counter()
        """Gradient bytes spilled to ("host->nvme") and read back from ("nvme->host") disk."""

    @staticmethod
    def offloads(chunk: Chunk) -> bool:
        """Whether the chunk's gradient shard lives on a storage tier."""
        return chunk.optim is not None and not chunk.optim.grad.tier.ADDRESSABLE

    @staticmethod
    def stages(chunk: Chunk) -> bool:
        """Whether the chunk's gradients are in its device home and its update may run on a
        host worker thread (optimizer states on a storage tier, or in host memory updated in
        backward): [Note: gradients staged from a device home]."""
        optim = chunk.optim
        return (
            optim is not None
            and optim.grads_in_home
            and (not optim.tier.ADDRESSABLE or optim.tier.name == "host")
            and chunk.home.tier.name == "device"
        )

    def stage(self, chunk: Chunk) -> torch.Tensor:
        """[Note: gradients staged from a device home]: a host buffer holding a copy of the
        chunk's device home (its gradients), lent until ``consumed(chunk)``; the copy is issued
        and waited for on the calling thread (an engine thread)."""
        buffer = self.lend(chunk, fresh=True)
        chunk.home.tier.read(chunk.home, buffer).wait()
        return buffer

    def hold(self, chunk: Chunk, *, fresh: bool) -> torch.Tensor:
        """The chunk's gradient shard in host memory: its buffer, or a buffer that the shard is
        read back into (``fresh``: nothing to read, the caller writes the first gradient)."""
        optim = chunk.optim
        if optim.grad_buffer is not None:
            if chunk in self._lru:
                self._lru.move_to_end(chunk)
            return optim.grad_buffer
        buffer = self._take()[: chunk.shard_size]
        if not fresh:
            self._io(chunk, "nvme->host", lambda: optim.grad.tier.read(optim.grad, buffer))
        optim.grad_buffer = buffer
        self._lru[chunk] = None
        return buffer

    def may_spill(self, chunk: Chunk) -> bool:
        """Whether ``hold(chunk)`` may write another chunk's buffer to disk to make room."""
        return chunk.optim.grad_buffer is None and not self._free and self._made >= self.count

    def lend(self, chunk: Chunk, *, fresh: bool = False) -> torch.Tensor:
        """``hold``, pinned until ``consumed(chunk)``: an update queued elsewhere reads it."""
        buffer = self.hold(chunk, fresh=fresh)
        with self._cond:
            self._lru.pop(chunk, None)
            self._pinned += 1
        return buffer

    def keep_on_disk(self, chunk: Chunk) -> None:
        """Start writing the chunk's held shard to its disk region: a speculative update will
        consume the buffer, and a rollback redoes the update from the region. The write is
        waited for before the buffer goes back (``consumed``)."""
        optim = chunk.optim
        if optim.grads_in_home:  # the update leaves this home alone until the commit
            self._over_home.add(chunk)
        handle = optim.grad.tier.write(optim.grad, optim.grad_buffer)
        self.moved_bytes["host->nvme"] += optim.grad.nbytes
        with self._cond:
            self._on_disk[chunk] = handle

    def kept_on_disk(self, chunk: Chunk, *, forget: bool = False) -> bool:
        """Whether the chunk's shard was written to its region in full (after ``consumed``)."""
        with self._cond:
            done = self._on_disk.pop(chunk, None) if forget else self._on_disk.get(chunk)
        return done is True

    def consumed(self, chunk: Chunk) -> None:
        """The update that was lent ``chunk``'s shard is done (or dropped): the buffer is free
        (once a write to disk started by ``keep_on_disk`` is complete)."""
        optim = chunk.optim
        with self._cond:
            handle = self._on_disk.get(chunk)
        if handle is not None and handle is not True and not isinstance(handle, OSError):
            try:
                handle.wait()
                done = True
            except OSError as err:  # the redo cannot use the region: the step says so
                done = err
            with self._cond:
                self._on_disk[chunk] = done
        with self._cond:
            buffer, optim.grad_buffer = optim.grad_buffer, None
            self._pinned -= 1
            if buffer is not None:
                self._free.append(buffer._base if buffer._base is not None else buffer)
            self._cond.notify_all()

    def drop(self, chunk: Chunk) -> None:
        """zero_grad: forget the chunk's gradients (no write)."""
        optim = chunk.optim
        with self._cond:
            self._on_disk.pop(chunk, None)
        self._over_home.discard(chunk)
        if optim.grad_buffer is None or chunk not in self._lru:
            return  # none, or lent to an update that gives it back through ``consumed``
        del self._lru[chunk]
        buffer, optim.grad_buffer = optim.grad_buffer, None
        with self._cond:
            self._free.append(buffer._base if buffer._base is not None else buffer)

    def spilled_over_home(self, chunk: Chunk) -> bool:
        """Whether a spill wrote ``chunk``'s gradients over its home's region since zero_grad
        (its parameters are then rewritten from the master)."""
        return chunk in self._over_home

    def spill_all(self) -> None:
        """Write every held shard to its NVMe region (before a re-layout reads them there)."""
        while self._lru:
            self._spill(next(iter(self._lru)))

    def close(self) -> None:
        self.host.unreserve(self.nbytes)
        self._free, self._lru = [], OrderedDict()

    # -- internals ---------------------------------------------------------------------------
    def _take(self) -> torch.Tensor:
        with self._cond:
            # an update in flight gives its buffer back: [Note: bounded waits]
            wait_until(
                self._cond,
                lambda: self._free or self._made < self.count or not self._pinned,
                f"an optimizer update to give back its host gradient buffer ({self._pinned} "
                "lent, none free: [Note: active gradient offloading])",
                self.timeout_s,
            )
            if self._free:
                return self._free.pop()
            if self._made < self.count:
                self._made += 1
                return self.memory.empty(self.numel, self.dtype, what="a gradient shard")
        self._spill(next(iter(self._lru)))  # nothing pinned: the LRU list holds every buffer
        with self._cond:
            return self._free.pop()

    def _spill(self, chunk: Chunk) -> None:
        optim = chunk.optim
        buffer = optim.grad_buffer
        if optim.grads_in_home:
            self._over_home.add(chunk)
        self._io(chunk, "host->nvme", lambda: optim.grad.tier.write(optim.grad, buffer))
        del self._lru[chunk]
        optim.grad_buffer = None
        with self._cond:
            self._free.append(buffer._base if buffer._base is not None else buffer)

    def _io(self, chunk: Chunk, direction: str, start) -> None:
        start().wait()
        self.moved_bytes[direction] += chunk.optim.grad.nbytes


def gradient_offload_for(groups, tiers: dict, dtype: torch.dtype) -> GradientOffload | None:
    """The engine's gradient offload when some chunk's gradient shard is on a storage tier
    (or staged from its device home: [Note: gradients staged from a device home]):
    ``grad_offload_buffers`` buffers as large as the largest shard of any chunk (as the planners
    count them), reserved in the host tier."""
    chunks = [c for g in groups for c in g.chunks]
    offloaded = sum(1 for c in chunks if GradientOffload.offloads(c) or GradientOffload.stages(c))
    if not offloaded:
        return None
    return GradientOffload(
        host=tiers["host"],
        numel=max(c.shard_size for c in chunks),
        dtype=dtype,
        count=grad_offload_buffers(offloaded),
    )


__all__ = [
    "GRAD_OFFLOAD_BUFFERS",
    "GradientOffload",
    "grad_offload_buffers",
    "gradient_offload_for",
]
