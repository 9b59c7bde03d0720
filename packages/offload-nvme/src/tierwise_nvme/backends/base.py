"""The I/O backend interface: aligned requests on open file descriptors, completed by callback."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from tierwise_nvme.errors import NVMeIOError


@dataclass(eq=False, kw_only=True)
class IORequest:
    """One transfer between a file range and a buffer.

    With an O_DIRECT backend, ``offset``, ``len(buffer)`` and the buffer address are multiples
    of 4096 (the NVMe tier's transfer layer guarantees it).
    """

    op: str
    """"read" (file -> buffer) or "write" (buffer -> file)."""
    fd: int
    """Open file descriptor."""
    path: str
    """The file's path, for error messages."""
    offset: int
    """Byte offset in the file."""
    buffer: memoryview
    """Writable byte buffer; it must stay alive and untouched until ``on_done`` runs."""
    on_done: Callable[[NVMeIOError | None], None]
    """Called once, from any thread, when every byte is transferred (None) or it failed."""


class PieceTracker:
    """Counts the pieces of one request; calls ``on_done`` with the first error after the last."""

    def __init__(self, request: IORequest, pieces: int) -> None:
        self._request = request
        self._remaining = pieces
        self._error: NVMeIOError | None = None
        self._lock = threading.Lock()

    def piece_done(self, error: NVMeIOError | None) -> None:
        with self._lock:
            if error is not None and self._error is None:
                self._error = error
            self._remaining -= 1
            last = self._remaining == 0
        if last:
            self._request.on_done(self._error)


def split(request: IORequest, block_size: int) -> Iterator[tuple[int, memoryview]]:
    """(file offset, buffer slice) pieces of at most ``block_size`` bytes."""
    size = len(request.buffer)
    for start in range(0, size, block_size):
        yield request.offset + start, request.buffer[start : start + block_size]


class IOBackend(ABC):
    """Moves bytes between buffers and files, many requests in flight."""

    name: str
    """Shown in stats and warnings: "libaio", "threads", "buffered"."""
    direct: bool
    """True when files are opened with O_DIRECT (requests must be aligned)."""

    @abstractmethod
    def submit(self, request: IORequest) -> None:
        """Start ``request``; its ``on_done`` runs when it is complete or has failed."""

    @abstractmethod
    def close(self) -> None:
        """Wait for requests in flight, then free threads and kernel contexts."""


__all__ = ["IOBackend", "IORequest", "PieceTracker", "split"]
