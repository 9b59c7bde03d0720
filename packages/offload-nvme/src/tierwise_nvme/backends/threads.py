"""Thread-pool backend: os.preadv / os.pwritev, on O_DIRECT files or through the page cache.

Used when libaio.so.1 is missing (direct=True) and where the file system refuses O_DIRECT
(direct=False, e.g. tmpfs). Each worker blocks in the system call with the GIL released.
"""

from __future__ import annotations

import errno
import os
from concurrent.futures import ThreadPoolExecutor

from tierwise_nvme.backends.base import IOBackend, IORequest, PieceTracker, split
from tierwise_nvme.errors import NVMeIOError, io_error, short_io_error

MAX_NO_PROGRESS = 3
"""Consecutive zero-byte transfers after which a short read/write is reported, not retried."""


def transfer(op: str, fd: int, path: str, offset: int, buffer: memoryview) -> None:
    """Move all of ``buffer`` at ``offset``, retrying short transfers; raise NVMeIOError."""
    call = os.preadv if op == "read" else os.pwritev
    done = stalls = 0
    size = len(buffer)
    while done < size:
        try:
            moved = call(fd, [buffer[done:]], offset + done)
        except InterruptedError:
            continue
        except OSError as err:
            raise io_error(op, path, offset + done, size - done, err.errno or 0) from None
        if moved == 0:
            stalls += 1
            if stalls >= MAX_NO_PROGRESS:
                raise short_io_error(op, path, offset, size, done)
        else:
            stalls = 0
        done += moved


class ThreadPoolBackend(IOBackend):
    """Runs pieces of ``block_size`` bytes on ``queue_depth`` worker threads."""

    def __init__(self, *, direct: bool, block_size: int, queue_depth: int) -> None:
        self.direct = direct
        self.name = "threads" if direct else "buffered"
        self.block_size = block_size
        self._pool = ThreadPoolExecutor(
            max_workers=queue_depth, thread_name_prefix=f"tierwise-nvme-{self.name}"
        )

    def submit(self, request: IORequest) -> None:
        pieces = list(split(request, self.block_size))
        tracker = PieceTracker(request, len(pieces))
        for offset, buffer in pieces:
            self._pool.submit(self._run, request, offset, buffer, tracker)

    @staticmethod
    def _run(request: IORequest, offset: int, buffer: memoryview, tracker: PieceTracker) -> None:
        error: NVMeIOError | None = None
        try:
            transfer(request.op, request.fd, request.path, offset, buffer)
        except NVMeIOError as err:
            error = err
        except Exception as err:  # a bug must fail the request, never hang its waiter
            error = io_error(request.op, request.path, offset, len(buffer), errno.EIO, repr(err))
        tracker.piece_done(error)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


__all__ = ["MAX_NO_PROGRESS", "ThreadPoolBackend", "transfer"]
