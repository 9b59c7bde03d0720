"""A file written in large aligned blocks by worker threads: the writing half of the export
pipeline.

[Note: pipelined export]
Writing a model out (``save_pretrained``, ``tierwise export``, a checkpoint's rank file) is a
stream of tensors appended to a file whose first bytes (the safetensors header) are known only
at the end. The caller's thread only decides where each tensor's bytes go (the next free byte
of the file) and hands the tensor to the workers, piece by piece; a worker converts its piece to
the dtype written straight into a staging block (or converts, then copies, when the piece
straddles two blocks or is misaligned for its dtype) and, when that fills the block, writes the
block with one ``os.pwrite`` at its place in the file, so conversions and several writes run
together and the caller reads the next values meanwhile. Blocks come from a ``WriteWindow``, a
fixed number of equal page-aligned buffers: the bytes in flight never exceed it, and the caller
waits for a block when all are taken. The file's first bytes, up to the first block boundary
(the header and the data's first bytes), are kept in their own buffer and written at the end
with the header; the last, partial block is written then too. With ``direct`` the file is opened
with ``O_DIRECT`` (block offsets and lengths are multiples of ``ALIGN``; the last write is
padded and the file truncated to its size), which writes at the disk's speed without filling
the page cache; where the file system refuses it, the same writes go through the page cache.
A finished file is fsynced. The bytes are those of writing each tensor converted, in order.
Worker threads touch host memory only ([Note: CUDA threading model]): a device tensor is copied
to the host by the caller before it is handed over.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

ALIGN = 4096
"""Alignment of O_DIRECT writes: block offsets and lengths are multiples of it."""
WINDOW_BLOCKS = 8
"""Staging blocks in a window: one being filled, the rest converting and writing."""
WRITE_WORKERS = 4
"""Threads that convert and write (the conversions and ``os.pwrite`` release the GIL)."""


def aligned_buffer(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """``nbytes`` of page-aligned host memory (an anonymous mapping) and a uint8 view of it."""
    memory = mmap.mmap(-1, max(nbytes, ALIGN))
    return memory, torch.frombuffer(memory, dtype=torch.uint8)[:nbytes]


class WriteFailed(OSError):
    """A write into a file of the export pipeline failed (the disk is full, the file is too
    large for the file system, the directory went away)."""


class WriteWindow:
    """The staging blocks and worker threads that files written through it share: at most
    ``window_bytes`` of blocks (``WINDOW_BLOCKS`` of them, each a multiple of ``ALIGN``)."""

    def __init__(self, window_bytes: int, *, workers: int = WRITE_WORKERS):
        self.block_bytes = max(ALIGN, window_bytes // WINDOW_BLOCKS // ALIGN * ALIGN)
        self.blocks = max(2, window_bytes // self.block_bytes)
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="tierwise-write")
        self._free: list[tuple[mmap.mmap, torch.Tensor]] = []
        self._made = 0
        self._changed = threading.Condition()

    @property
    def nbytes(self) -> int:
        """Host bytes the window may hold."""
        return self.blocks * self.block_bytes

    def take(self, failed) -> tuple[mmap.mmap, torch.Tensor]:
        """A free block, waiting for one when all are in flight; raises ``failed()``'s error
        when a write fails meanwhile (its block may never come back)."""
        with self._changed:
            while True:
                error = failed()
                if error is not None:
                    raise error
                if self._free:
                    return self._free.pop()
                if self._made < self.blocks:
                    self._made += 1
                    return aligned_buffer(self.block_bytes)
                self._changed.wait()

    def give(self, block: tuple[mmap.mmap, torch.Tensor]) -> None:
        with self._changed:
            self._free.append(block)
            self._changed.notify_all()

    def wake(self) -> None:
        """Wake a caller waiting in ``take`` (a write failed)."""
        with self._changed:
            self._changed.notify_all()

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self._free.clear()


class BlockFile:
    """One file written through a ``WriteWindow``: ``head_bytes`` at its start are written by
    ``finish``, everything after is appended by ``append`` ([Note: pipelined export])."""

    def __init__(self, path: str | os.PathLike, window: WriteWindow, *, direct: bool = False):
        self.path = Path(path)
        self.window = window
        self.size = 0
        """Bytes the file will have (the head included once it is given)."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        self.direct = direct and hasattr(os, "O_DIRECT")
        try:
            self._fd = os.open(self.path, flags | (os.O_DIRECT if self.direct else 0), 0o666)
        except OSError as err:
            if not self.direct or err.errno != errno.EINVAL:
                raise
            self.direct = False  # a file system without O_DIRECT (tmpfs): through the page cache
            self._fd = os.open(self.path, flags, 0o666)
        self._lock = threading.Lock()
        self._blocks: dict[int, tuple[mmap.mmap, torch.Tensor]] = {}
        self._filled: dict[int, int] = {}
        self._head_end = 0
        self._head: tuple[mmap.mmap, torch.Tensor] | None = None
        self._futures: list[Future] = []
        self._error: BaseException | None = None

    def reserve_head(self, nbytes: int) -> None:
        """Keep the first ``nbytes`` of the file for ``finish`` (before the first append)."""
        self._head_end = -(-nbytes // ALIGN) * ALIGN
        self._head = aligned_buffer(self._head_end)
        self.size = nbytes

    def append(self, values: torch.Tensor, dtype: torch.dtype) -> None:
        """Append ``values`` (on the host; the caller leaves it unchanged until ``finish``)
        converted to ``dtype``; returns once the pieces are handed to the workers."""
        self._raise_failure()
        flat = values.detach().reshape(-1)
        item = dtype.itemsize
        at, count = self.size, flat.numel()
        self.size += count * item
        done = 0
        while done < count:
            byte = at + done * item
            region, _, room = self._where(byte)
            piece = min(count - done, -(-room // item))
            last = byte + piece * item - 1
            for index in range(region, self._where(last)[0] + 1):
                self._block(index)
            future = self.window.pool.submit(self._place, flat[done : done + piece], dtype, byte)
            self._futures.append(future)
            done += piece
        if len(self._futures) > 4 * self.window.blocks:
            self._futures = [f for f in self._futures if not f.done()]

    def finish(self, head: bytes) -> None:
        """Write ``head`` over the reserved start, the last partial block, truncate to the
        size, fsync and close; raises the first failed write's error."""
        for future in self._futures:
            future.result()
        self._raise_failure()
        if len(head) > self._head_end:
            raise ValueError(f"{self.path}: head of {len(head)} bytes over the reserved")
        try:
            for index in sorted(self._blocks):  # the last, partial block (all others are full)
                start = self._start(index)
                self._write(self._blocks[index][0], start, self.size - start)
            if self._head is not None:
                self._head[1][: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
                self._write(self._head[0], 0, min(self._head_end, self.size))
            os.ftruncate(self._fd, self.size)
            os.fsync(self._fd)
        except OSError as err:
            raise self._failure(err) from None
        finally:
            self._release()

    def abort(self) -> None:
        """Stop, close and remove the file (a failed write leaves nothing)."""
        with self._lock:
            if self._error is None:
                self._error = WriteFailed(f"{self.path}: aborted")
        for future in self._futures:
            future.exception()  # wait: no worker may touch a block handed back
        self._release()
        self.path.unlink(missing_ok=True)

    # -- workers --------------------------------------------------------------------------
    def _place(self, values: torch.Tensor, dtype: torch.dtype, byte: int) -> None:
        if self._error is not None:
            return
        try:
            nbytes = values.numel() * dtype.itemsize
            region, offset, room = self._where(byte)
            with self._lock:
                buffer = self._buffer(region)
            if nbytes <= room and offset % dtype.itemsize == 0:  # converted straight into place
                buffer[offset : offset + nbytes].view(dtype).copy_(values)
                self._filled_up(region, nbytes)
                return
            data = values.to(dtype).contiguous().view(torch.uint8)
            done = 0
            while done < nbytes:
                region, offset, room = self._where(byte + done)
                with self._lock:
                    buffer = self._buffer(region)
                n = min(room, nbytes - done)
                buffer[offset : offset + n].copy_(data[done : done + n])
                self._filled_up(region, n)
                done += n
        except BaseException as err:
            with self._lock:
                if self._error is None:
                    self._error = self._failure(err) if isinstance(err, OSError) else err
            self.window.wake()

    def _filled_up(self, region: int, nbytes: int) -> None:
        """Count ``nbytes`` placed in ``region``; a data block now full is written and given
        back to the window."""
        if region < 0:
            return  # the head: written by finish
        with self._lock:
            self._filled[region] += nbytes
            if self._filled[region] < self.window.block_bytes:
                return
            block = self._blocks.pop(region)
            del self._filled[region]
        try:
            self._write(block[0], self._start(region), self.window.block_bytes)
        finally:
            self.window.give(block)

    # -- placement ------------------------------------------------------------------------
    def _where(self, byte: int) -> tuple[int, int, int]:
        """(region, offset in it, bytes left in it) of file byte ``byte``: region -1 is the
        head, data block ``k`` starts at ``_head_end + k * block_bytes``."""
        if byte < self._head_end:
            return -1, byte, self._head_end - byte
        block = self.window.block_bytes
        region, offset = divmod(byte - self._head_end, block)
        return region, offset, block - offset

    def _start(self, region: int) -> int:
        return self._head_end + region * self.window.block_bytes

    def _block(self, region: int) -> None:
        """Take the window block for data region ``region`` (caller's thread, in order)."""
        if region < 0:
            return
        with self._lock:
            if region in self._blocks or region in self._filled:
                return
        block = self.window.take(lambda: self._error)
        with self._lock:
            self._blocks[region] = block
            self._filled[region] = 0

    def _buffer(self, region: int) -> torch.Tensor:
        return self._head[1] if region < 0 else self._blocks[region][1]

    def _write(self, memory: mmap.mmap, at: int, nbytes: int) -> None:
        length = -(-nbytes // ALIGN) * ALIGN if self.direct else nbytes
        view = memoryview(memory)[:length]
        done = 0
        while done < length:
            written = os.pwrite(self._fd, view[done:], at + done)
            if written <= 0:
                raise OSError(errno.EIO, "short write")
            done += written

    def _failure(self, err: OSError) -> WriteFailed:
        if isinstance(err, WriteFailed):
            return err
        what = {errno.ENOSPC: "the disk is full", errno.EFBIG: "the file is too large"}.get(
            err.errno, err.strerror or str(err)
        )
        return WriteFailed(
            err.errno,
            f"{self.path}: writing failed after {self.size} bytes were asked for: {what}; free "
            "space or write somewhere else",
        )

    def _raise_failure(self) -> None:
        if self._error is not None:
            raise self._error

    def _release(self) -> None:
        with self._lock:
            blocks = list(self._blocks.values())
            self._blocks.clear()
            self._filled.clear()
            self._head = None
        for block in blocks:
            self.window.give(block)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
