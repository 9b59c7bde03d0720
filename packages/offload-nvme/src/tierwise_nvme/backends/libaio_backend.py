"""Linux AIO backend through python-libaio (PyPI ``libaio``, ctypes over libaio.so.1).

Requests are split into ``block_size`` pieces; at most ``queue_depth`` pieces are in the
kernel at once, the rest wait in a queue.

[Note: libaio completion]
Every submitted block carries an eventfd. One reaper thread blocks in ``read(eventfd)`` (no
busy-wait; the GIL is released), then collects whatever the completion ring holds with a zero
timeout. The kernel signals the eventfd only after the event is in the ring, so an event is
never missed: at worst a wake-up finds its event already collected and returns nothing.
Completions are handled outside the submission lock, so copying out of bounce buffers never
blocks new submissions. A short transfer is resubmitted for the remaining bytes; one that
moves nothing, or a negative result (-errno), fails its request with an NVMeIOError.
"""

from __future__ import annotations

import errno
import threading
from collections import deque

from tierwise_nvme.backends.base import IOBackend, IORequest, PieceTracker, split
from tierwise_nvme.backends.threads import MAX_NO_PROGRESS
from tierwise_nvme.errors import NVMeIOError, io_error, short_io_error


def load_libaio():
    """The python-libaio module; raises OSError (no libaio.so.1) or ImportError (no package)."""
    import libaio

    return libaio


class _AioPiece:
    """One block in the kernel: a slice of a request, plus how much of it is done."""

    __slots__ = ("buffer", "done", "offset", "request", "stalls", "tracker")

    def __init__(self, request: IORequest, offset: int, buffer: memoryview, tracker: PieceTracker):
        self.request = request
        self.offset = offset
        self.buffer = buffer
        self.tracker = tracker
        self.done = 0
        self.stalls = 0


class LibaioBackend(IOBackend):
    """Kernel asynchronous I/O on O_DIRECT files. See [Note: libaio completion]."""

    name = "libaio"
    direct = True

    def __init__(self, *, block_size: int, queue_depth: int) -> None:
        self._aio = load_libaio()
        self.block_size = block_size
        self.queue_depth = queue_depth
        self._ctx = self._aio.AIOContext(queue_depth)
        self._eventfd = self._aio.EventFD()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._waiting: deque[_AioPiece] = deque()
        self._in_flight = 0
        self._closing = False
        self._reaper = threading.Thread(target=self._reap, name="tierwise-nvme-libaio", daemon=True)
        self._reaper.start()

    # -- submission ------------------------------------------------------------------------
    def submit(self, request: IORequest) -> None:
        pieces = list(split(request, self.block_size))
        tracker = PieceTracker(request, len(pieces))
        with self._lock:
            if self._closing:
                raise RuntimeError("the libaio backend is closed")
            self._waiting.extend(_AioPiece(request, off, buf, tracker) for off, buf in pieces)
            failed = self._pump()
        self._fail(failed)

    def _block(self, piece: _AioPiece):
        mode = (
            self._aio.AIOBLOCK_MODE_READ
            if piece.request.op == "read"
            else self._aio.AIOBLOCK_MODE_WRITE
        )
        block = self._aio.AIOBlock(
            mode,
            piece.request.fd,
            [piece.buffer[piece.done :]],
            piece.offset + piece.done,
            eventfd=self._eventfd,
        )
        block.piece = piece
        return block

    def _pump(self) -> list[tuple[_AioPiece, int]]:
        """Submit waiting pieces while the queue has room (lock held). Returns refused pieces."""
        failed = []
        while self._waiting and self._in_flight < self.queue_depth:
            room = self.queue_depth - self._in_flight
            batch = [
                self._block(self._waiting.popleft()) for _ in range(min(room, len(self._waiting)))
            ]
            try:
                submitted = self._ctx.submit(batch)
            except OSError as err:  # the first block was refused; the others were not tried
                if err.errno == errno.EAGAIN and self._in_flight:
                    submitted, refused = 0, None  # kernel queue full: retry after completions
                else:
                    submitted, refused = 1, batch[0].piece
                    failed.append((refused, err.errno or errno.EIO))
            else:
                refused = None
            self._in_flight += submitted - (refused is not None)
            for block in reversed(batch[submitted:]):
                self._waiting.appendleft(block.piece)
            if submitted == 0:
                break
        return failed

    # -- completion ------------------------------------------------------------------------
    def _reap(self) -> None:
        while True:
            self._eventfd.read()  # blocks until at least one completion (or close) is signalled
            with self._lock:
                events = self._ctx.getEvents(min_nr=0, nr=self.queue_depth, timeout=0)
                self._in_flight -= len(events)
                if self._closing and self._in_flight == 0 and not self._waiting:
                    self._idle.notify_all()
                    return
            for block, result, _ in events:
                self._complete(block.piece, result)
            with self._lock:
                failed = self._pump()
                if self._in_flight == 0 and not self._waiting:
                    self._idle.notify_all()
            self._fail(failed)

    def _complete(self, piece: _AioPiece, result: int) -> None:
        request = piece.request
        remaining = len(piece.buffer) - piece.done
        if result < 0:
            piece.tracker.piece_done(
                io_error(request.op, request.path, piece.offset + piece.done, remaining, -result)
            )
            return
        piece.done += result
        piece.stalls = piece.stalls + 1 if result == 0 else 0
        if piece.done >= len(piece.buffer):
            piece.tracker.piece_done(None)
        elif piece.stalls >= MAX_NO_PROGRESS:
            piece.tracker.piece_done(
                short_io_error(
                    request.op, request.path, piece.offset, len(piece.buffer), piece.done
                )
            )
        else:  # short transfer: resubmit the rest
            with self._lock:
                self._waiting.appendleft(piece)

    @staticmethod
    def _fail(failed: list[tuple[_AioPiece, int]]) -> None:
        for piece, code in failed:
            request = piece.request
            error: NVMeIOError = io_error(
                request.op,
                request.path,
                piece.offset + piece.done,
                len(piece.buffer) - piece.done,
                code,
                "io_submit refused it",
            )
            piece.tracker.piece_done(error)

    def close(self) -> None:
        with self._lock:
            if self._closing:
                return
            while self._in_flight or self._waiting:
                self._idle.wait()
            self._closing = True
        self._eventfd.write(1)  # wake the reaper so it sees _closing
        self._reaper.join()
        self._ctx.close()
        self._eventfd.close()


__all__ = ["LibaioBackend", "load_libaio"]
