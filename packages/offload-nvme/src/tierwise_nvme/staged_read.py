"""Reads into destinations O_DIRECT cannot fill in place, streamed through a StagingPool.

[Note: staged reads]
O_DIRECT moves whole pages between the file and page-aligned memory. An rCache chunk (an
ordinary torch allocation), or any host tensor whose address is misaligned differently from its
file offset, cannot be filled in place. Such a read is cut into pieces of at most one staging
buffer (the tier's block size) over the page-widened file range; each piece takes a buffer from
the tier's bounded StagingPool, is read into it by the backend, and its bytes are copied into
the destination by the thread that completes the piece, which then returns the buffer and
starts the next waiting piece. Destinations are host memory only: a device tensor is read
through a pinned buffer and copied by the engine's thread ([Note: storage reads into device
memory]). So:
- ``read`` returns at once with a handle: pieces that find no free buffer wait in a FIFO
  queue (oldest read first, so a chunk demanded first is complete first) and start as buffers
  come back; the caller never blocks on the pool, and the pool never grows past its count.
- Copies of finished pieces overlap the disk reads of the next ones, so a staged read runs
  at nearly the speed of an aligned one, with a few blocks of host memory instead of a bounce
  copy of the whole destination.
- Buffers are returned by completions alone, never by the caller's ``wait()``, so reads in
  flight always make progress; the pool must be this object's alone (a foreign blocking
  ``acquire`` could take a returned buffer without starting a waiting piece).
The destination must stay alive and its storage unresized until the handle completes (the
handle keeps a reference; an engine must not free a chunk's storage under a read in flight).
"""

from __future__ import annotations

import ctypes
import errno
import threading
from collections import deque
from dataclasses import dataclass

import torch

from tierwise_nvme.backends.base import IOBackend, IORequest
from tierwise_nvme.buffers import memoryview_of
from tierwise_nvme.errors import NVMeIOError, io_error
from tierwise_nvme.staging import StagingPool
from tierwise_nvme.swapfile import SwapFile
from tierwise_nvme.transfer import NVMeHandle


@dataclass(eq=False)
class _StagedPiece:
    """File bytes ``[lo, hi)`` (page-aligned) of a read whose wanted bytes start at ``start``
    of the file and land in ``dest`` (a flat uint8 view of the destination)."""

    file: SwapFile
    lo: int
    hi: int
    start: int
    dest: torch.Tensor
    handle: NVMeHandle


class StagedReads:
    """Streams reads through ``pool`` (see [Note: staged reads])."""

    def __init__(self, backend: IOBackend, pool: StagingPool) -> None:
        self.backend = backend
        self.pool = pool
        self._waiting: deque[_StagedPiece] = deque()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._outstanding = 0  # pieces queued or in flight

    def pieces(self, lo: int, hi: int) -> int:
        """How many pieces a read of the page-aligned file range ``[lo, hi)`` has."""
        return -(-(hi - lo) // self.pool.buffer_bytes)

    def start(
        self, file: SwapFile, lo: int, hi: int, start: int, dest: torch.Tensor, handle: NVMeHandle
    ) -> None:
        """Queue the pieces of file range ``[lo, hi)`` (page-aligned, covering the wanted
        ``[start, start + dest.numel())``) and start as many as there are free buffers;
        ``handle`` counts ``pieces(lo, hi)`` parts."""
        step = self.pool.buffer_bytes
        with self._lock:
            for piece_lo in range(lo, hi, step):
                piece_hi = min(piece_lo + step, hi)
                self._waiting.append(_StagedPiece(file, piece_lo, piece_hi, start, dest, handle))
                self._outstanding += 1
        self._pump()

    def drain(self) -> None:
        """Block until every queued piece is complete."""
        with self._idle:
            while self._outstanding:
                self._idle.wait()

    def _pump(self) -> None:
        """Start waiting pieces while buffers are free (any thread; never blocks)."""
        while True:
            with self._lock:
                if not self._waiting:
                    return
                buffer = self.pool.acquire(self.pool.buffer_bytes, torch.uint8, block=False)
                if buffer is None:
                    return  # a completion returns a buffer and pumps again
                piece = self._waiting.popleft()
            self._submit(piece, buffer)

    def _submit(self, piece: _StagedPiece, buffer: torch.Tensor) -> None:
        size = piece.hi - piece.lo

        def on_done(error: NVMeIOError | None) -> None:
            self._finish(piece, buffer, error)

        request = IORequest(
            op="read",
            fd=piece.file.fd,
            path=str(piece.file.path),
            offset=piece.lo,
            buffer=memoryview_of(buffer[:size]),
            on_done=on_done,
        )
        try:
            self.backend.submit(request)
        except Exception as err:
            code = getattr(err, "errno", None) or errno.EIO
            self._finish(
                piece,
                buffer,
                io_error("read", str(piece.file.path), piece.lo, size, code, repr(err)),
            )

    def _finish(
        self, piece: _StagedPiece, buffer: torch.Tensor, error: BaseException | None
    ) -> None:
        """Copy a finished piece's wanted bytes out, return its buffer, start the next piece."""
        try:
            if error is None:
                copy_out(piece, buffer)
        except Exception as err:  # never let a copy error hang the waiter
            error = err
        finally:
            self.pool.release(buffer)
        piece.handle.part_done(error)
        with self._lock:
            self._outstanding -= 1
            if not self._outstanding:
                self._idle.notify_all()
        self._pump()


def copy_out(piece: _StagedPiece, buffer: torch.Tensor) -> None:
    """Copy the wanted bytes of ``piece`` from its staging ``buffer`` into its destination."""
    end = piece.start + piece.dest.numel()
    lo, hi = max(piece.lo, piece.start), min(piece.hi, end)
    if hi <= lo:
        return
    if piece.dest.device.type != "cpu":  # [Note: storage reads into device memory]
        raise RuntimeError(
            "tierwise-nvme bug: a staged read into device memory (completion threads fill host "
            "memory only)"
        )
    # one memcpy without the GIL or intra-op threads
    ctypes.memmove(
        piece.dest.data_ptr() + (lo - piece.start), buffer.data_ptr() + (lo - piece.lo), hi - lo
    )


__all__ = ["StagedReads", "copy_out"]
