"""Checking a checkpoint file's SHA-256 with the reads that use it: one pass over the file.

[Note: hashing while reading]
``tierwise export`` needs the master values of a rank file, and the manifest's checksum covers
the whole file (masters and Adam moments). Checking it in a pass of its own reads the file
twice. Instead, every read of the file goes through a ``HashingReads``. It keeps a cursor: the
bytes before it have been hashed, in file order. A read that starts at or after the cursor first
reads the bytes between (the moments of the chunk just passed, which the export does not use)
in blocks and hashes them, then reads the asked bytes into the caller's buffer and hashes those
too. The cursor moves to its end. A read before the cursor (out of the file's order) is a plain
``preadv`` of bytes already hashed, counted in ``reread_bytes``. ``digest`` hashes the rest of
the file and returns the SHA-256 of all of it: equal to ``hashlib`` over the file. A reader that
goes through the file in its order, as the export does (the rank file holds its pieces in the
model's chunk order, [Note: checkpoint by parameter name]), so reads each byte once.

Hashing runs on a thread of its own, one buffer behind the reads: a buffer's hash starts once
it is read and is waited for after the next read, so hashing (hashlib releases the GIL) and the
disk overlap, and at most one buffer besides the caller's is held for it. The caller leaves the
bytes it was given unchanged until the next read or ``digest`` (a changed byte fails the check,
it cannot pass a corrupt file). Blocks read only to be hashed alternate between two buffers.

Nothing read may be used for output before ``digest`` matched the manifest (the export publishes
its shards only then: [Note: pipelined export]). Calls must not overlap: one thread reads.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

SKIP_BLOCK_BYTES = 4 << 20
"""Bytes read per step while hashing a range nobody asked for (reused buffer)."""
ADVISE_AHEAD_BYTES = 64 << 20
"""Bytes past the cursor the kernel is asked to read ahead (``POSIX_FADV_WILLNEED``): the
disk works on the next parameter while this one is converted, within the page cache (which
the kernel may take back), not the process's memory."""


class HashingReads:
    """Reads of one file that hash it, in file order, as they go ([Note: hashing while
    reading])."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.size = self.path.stat().st_size
        self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self._hash = hashlib.sha256()
        self._cursor = 0
        self._hashing = ThreadPoolExecutor(1, thread_name_prefix="tierwise-hash")
        self._last: Future | None = None
        self._advised = 0  # file bytes before it were given to the kernel to read ahead
        self._skip: list[memoryview] = []
        self.bytes_read = 0
        """Bytes read from the file so far (each file byte once, plus ``reread_bytes``)."""
        self.reread_bytes = 0
        """Bytes read a second time: asked for behind the cursor."""

    def read_into(self, view: memoryview, offset: int) -> None:
        """Fill ``view`` (bytes) with the file's bytes from ``offset``; raises ``EOFError``
        when the file ends first. A read that starts behind the cursor is not hashed (the
        bytes before the cursor were; any after it are when the cursor passes them)."""
        if offset < self._cursor:
            self.reread_bytes += len(view)
            self._pread(view, offset)
            return
        self._hash_up_to(offset)
        self._pread(view, offset)
        self._hash_next(view)
        self._cursor = offset + len(view)
        self._advise_ahead()

    def digest(self) -> str:
        """The file's SHA-256 (hex): the rest of the file is read and hashed first."""
        self._hash_up_to(self.size)
        self._wait_hashed()
        return self._hash.hexdigest()

    def close(self) -> None:
        self._hashing.shutdown(wait=True)
        self._last = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _advise_ahead(self) -> None:
        """Ask the kernel to read the next ``ADVISE_AHEAD_BYTES`` (once each; no-op where
        ``posix_fadvise`` is missing)."""
        end = min(self.size, self._cursor + ADVISE_AHEAD_BYTES)
        if end - self._advised < ADVISE_AHEAD_BYTES // 4 or not hasattr(os, "posix_fadvise"):
            return
        start = max(self._cursor, self._advised)
        os.posix_fadvise(self._fd, start, end - start, os.POSIX_FADV_WILLNEED)
        self._advised = end

    def _hash_next(self, view: memoryview) -> None:
        """Hash ``view`` after the bytes before it, on the hashing thread (read just now: the
        previous buffer's hash is waited for first, so one is in hashing at a time)."""
        self._wait_hashed()
        self._last = self._hashing.submit(self._hash.update, view)

    def _wait_hashed(self) -> None:
        if self._last is not None:
            last, self._last = self._last, None
            last.result()

    def _hash_up_to(self, offset: int) -> None:
        if offset <= self._cursor:
            return
        if not self._skip:  # two: one read while the other is hashed
            self._skip = [memoryview(bytearray(SKIP_BLOCK_BYTES)) for _ in range(2)]
        while self._cursor < offset:
            buffer = self._skip[0]
            self._skip.reverse()
            part = buffer[: min(SKIP_BLOCK_BYTES, offset - self._cursor)]
            self._pread(part, self._cursor)  # its buffer's previous hash was waited for
            self._hash_next(part)
            self._cursor += len(part)
            self._advise_ahead()

    def _pread(self, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got <= 0:
                raise EOFError(f"{self.path}: ends at byte {offset + done}, read asked for more")
            done += got
        self.bytes_read += len(view)
