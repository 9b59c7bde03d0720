"""A home's parameters cast from its fp32 master on a storage tier, read and copied in pieces
that overlap: ``MasterCast``.

[Note: casting a master from storage]
A chunk whose home holds gradients gets its parameters from its fp32 master ([Note: gradients
in the parameter payload]); with the master on a storage tier (NVMe) that is a disk read, a cast
to the compute dtype and, for an rCache block or a device home, a copy into device memory. Done
one piece at a time with a synchronous read and a synchronous copy, the disk, the host and the
device take turns. Instead:

- Up to ``DEPTH`` pieces are read at once, each into a host buffer of the target tier's
  ``cast_buffers`` (a ledger pool: [Note: reused page-locked buffers]); I/O completion threads
  fill those buffers and touch nothing else ([Note: CUDA threading model]).
- On the engine's thread, as a piece's read is done (``progress``, called as other loads start;
  or ``wait``), it is cast into the target: into host memory directly; into the device tier's
  memory through a second buffer of the pool in the target's dtype (the cast runs on the host)
  and a ``non_blocking`` copy from it on the stream current when the cast was started (a load's
  side stream: [Note: prefetch overlap]), an event recorded after it. Its read buffer goes back
  at once and the next piece's read is issued into it, so the disk reads ahead while pieces are
  cast and copied.
- A cast buffer goes back with its copy's event (``ReusedBuffers.give(after=...)``): the pool
  keeps it referenced until the copy has completed, so host memory a copy reads is never lent
  again or freed under it ([Note: writes from host memory]). At most ``DEPTH`` copies of one cast
  are in flight; a further piece first waits for the oldest (a copy of one piece, not the
  device's whole queue), which bounds the pool at ``DEPTH`` read and ``DEPTH`` cast buffers.
- ``wait`` casts what is left and makes the current stream wait for the last copy's event
  (kernels reading the target run after it; the host does not wait).

The cast is the same rounding of the same fp32 values as a cast on the device, so the
parameters are bitwise what the home had. On a CPU the device tier's memory is host RAM: the
copies are synchronous and there is no event; the order of reads, casts and copies is the same.
``tests/core/test_master_cast.py`` checks it there (no blocking copy into the device tier, no
worker thread touching it, the ledger bound, bitwise the plain cast);
``tests/cuda/test_master_cast_on_gpu.py`` on a GPU.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import torch

from tierwise.tiers.base import IOHandle

if TYPE_CHECKING:
    from tierwise.tiers.base import Slab
    from tierwise.tiers.ledger import ReusedBuffers

DEPTH = 2
"""Pieces of one cast read ahead, and copies of one cast in flight, at most."""


class MasterCast(IOHandle):
    """``out`` = ``master[offset : offset + out.numel()]`` rounded to ``out``'s dtype, a piece
    at a time: see [Note: casting a master from storage]. Engine thread only."""

    def __init__(
        self,
        master: Slab,
        out: torch.Tensor,
        *,
        offset: int,
        piece: int,
        buffers: ReusedBuffers | None,
        to_device: bool,
    ) -> None:
        self.master, self.out, self.offset, self.piece = master, out, offset, piece
        self.buffers = buffers
        """The target tier's ``cast_buffers`` (None: plain host buffers, for a caller that
        holds only one piece of host memory itself: ``cast_master_over``)."""
        self.to_device = to_device
        """``out`` is the device tier's memory: copied from a cast buffer without blocking."""
        accelerator = out.device.type not in ("cpu", "meta")
        self.stream = torch.accelerator.current_stream(out.device) if accelerator else None
        """The stream the copies are queued on: the one current when the cast started."""
        self._next = 0
        """Element (of ``out``) where the next piece's read starts."""
        self._reads: deque[tuple[int, torch.Tensor, IOHandle]] = deque()
        """(element of ``out``, read buffer, read) in flight, oldest first."""
        self._copies: deque[tuple[object, torch.Tensor]] = deque()
        """(event, cast buffer) of this cast's copies into device memory, oldest first."""
        self.last_event = None
        self._read_ahead()

    def _take(self, numel: int, dtype: torch.dtype, what: str) -> torch.Tensor:
        if self.buffers is None:
            return torch.empty(numel, dtype=dtype)
        return self.buffers.take(numel, dtype, what=what)

    def _give(self, buffer: torch.Tensor, after: object = None) -> None:
        if self.buffers is not None:
            self.buffers.give(buffer, after=after)

    def _read_ahead(self) -> None:
        numel = self.out.numel()
        while len(self._reads) < DEPTH and self._next < numel:
            n = min(self.piece, numel - self._next)
            buffer = self._take(n, self.master.dtype, "a master piece read from storage")
            read = self.master.tier.read(self.master, buffer, offset=self.offset + self._next)
            self._reads.append((self._next, buffer, read))
            self._next += n

    def _cast_oldest(self) -> None:
        at, buffer, read = self._reads.popleft()
        try:
            read.wait()  # bounded, and its error reaches the engine's thread
            target = self.out[at : at + buffer.numel()]
            if not self.to_device:
                target.copy_(buffer)
            else:
                self._copy_into(target, buffer)
        finally:
            self._give(buffer)
        self._read_ahead()

    def _copy_into(self, target: torch.Tensor, values: torch.Tensor) -> None:
        """``target`` (device memory) = ``values`` cast, through a cast buffer."""
        if len(self._copies) >= DEPTH:  # the oldest copy's buffer before a new one
            event, staged = self._copies.popleft()
            if event is not None:
                event.synchronize()
            self._give(staged)
        staged = self._take(values.numel(), target.dtype, "a master piece cast for the device")
        staged.copy_(values)
        event = None
        if self.stream is None:
            target.copy_(staged, non_blocking=True)
        else:
            with self.stream:
                target.copy_(staged, non_blocking=True)
                event = self.stream.record_event()
        self.last_event = event
        self._copies.append((event, staged))

    def progress(self) -> None:
        """Cast the pieces whose reads are done, without waiting for a read."""
        while self._reads and self._reads[0][2].done():
            self._cast_oldest()

    def wait(self) -> None:
        while self._reads:
            self._cast_oldest()
        while self._copies:  # kept by the pool until each copy completes
            event, staged = self._copies.popleft()
            self._give(staged, after=event)
        if self.last_event is not None:
            torch.accelerator.current_stream(self.out.device).wait_event(self.last_event)

    def done(self) -> bool:
        return not self._reads and (self.last_event is None or self.last_event.query())


__all__ = ["DEPTH", "MasterCast"]
