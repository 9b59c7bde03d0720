"""SwapFile: one preallocated file per process, tier instance, rank and kind of data.

[Note: stale swap files]
File names are ``tierwise-<pid>-<token>-<instance>-r<rank>-<kind>@<host>.swap``: the random token
makes every name new, so a restarted process that got the same pid and hostname as a crashed one
(a container restarted in place) never meets the old file. A live file is known by its lock: the
process that created it holds an exclusive ``flock`` on it until it closes it, and the kernel
drops the lock when the process dies. A starting tier deletes the files of this host that it can
lock (no live process holds them), without touching those of live runs or of other hosts sharing
the directory. Files from before the token have no lock: their pid decides, as it did.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import secrets
import socket
from pathlib import Path

from tierwise.units import format_bytes

from tierwise_nvme.allocator import ExtentAllocator
from tierwise_nvme.errors import NVMeSpaceError, io_error
from tierwise_nvme.options import ALIGNMENT

logger = logging.getLogger("tierwise.nvme")

_NAME = re.compile(
    r"^tierwise-(?P<pid>\d+)-(?:(?P<token>[0-9a-f]{16})-)?\d+-r\d+-[a-z0-9_]+@(?P<host>.+)\.swap$"
)


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname()) or "localhost"


def swap_file_name(*, pid: int, instance: int, rank: int, kind: str) -> str:
    """A name no other file had ([Note: stale swap files])."""
    return f"tierwise-{pid}-{secrets.token_hex(8)}-{instance}-r{rank}-{kind}@{_host()}.swap"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def _lock(fd: int) -> bool:
    """Take the exclusive lock on ``fd`` without waiting; False when another holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _unlink_if_stale(path: Path, *, locked_name: bool) -> int | None:
    """Delete ``path`` when no live process holds it; its size, or None when it was kept."""
    if not locked_name:  # from before the lock: the pid decides
        match = _NAME.match(path.name)
        if match is None or pid_alive(int(match["pid"])):
            return None
        size = path.stat().st_size
        path.unlink()
        return size
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if not _lock(fd):
            return None  # a live process holds it
        size = os.fstat(fd).st_size
        path.unlink()
        return size
    finally:
        os.close(fd)


def remove_stale_files(directory: Path) -> list[Path]:
    """Delete swap files in ``directory`` left by dead processes of this host; return them."""
    removed = []
    host = _host()
    for path in directory.iterdir():
        match = _NAME.match(path.name)
        if match is None or match["host"] != host:
            continue
        try:
            size = _unlink_if_stale(path, locked_name=match["token"] is not None)
        except FileNotFoundError:  # another starting process removed it first
            continue
        if size is None:
            continue
        logger.warning("nvme tier: removed %s (%s) left by a crashed run", path, format_bytes(size))
        removed.append(path)
    return removed


def free_bytes(directory: Path) -> int:
    """Bytes an unprivileged process may still write on the file system of ``directory``."""
    stat = os.statvfs(directory)
    return stat.f_bavail * stat.f_frsize


def align_up(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


class SwapFile:
    """A file that grows by preallocation and hands out ALIGNMENT-aligned byte ranges."""

    def __init__(self, path: Path, *, direct: bool, kind: str) -> None:
        self.path = path
        self.kind = kind
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
        self.fd = os.open(path, flags, 0o600)
        _lock(self.fd)  # held until close: the file is live ([Note: stale swap files])
        self.allocator = ExtentAllocator()

    @property
    def size(self) -> int:
        return self.allocator.size

    def reserve(self, nbytes: int) -> None:
        """Preallocate so that ``nbytes`` more can be allocated without growing the file."""
        missing = align_up(nbytes) - self.allocator.free_bytes
        if missing > 0:
            self._grow(self.size + missing)

    def allocate(self, nbytes: int) -> int:
        """Offset of ``nbytes`` (rounded up to ALIGNMENT) of preallocated room."""
        nbytes = align_up(nbytes)
        offset = self.allocator.allocate(nbytes)
        if offset is None:
            self._grow(self.size + nbytes - self.allocator.tail_free())
            offset = self.allocator.allocate(nbytes)
        return offset

    def free(self, offset: int, nbytes: int) -> None:
        self.allocator.free(offset, align_up(nbytes))

    def _grow(self, new_size: int) -> None:
        """Preallocate up to ``new_size`` bytes, after checking the file system has room."""
        need = new_size - self.size
        available = free_bytes(self.path.parent)
        if need > available:
            raise NVMeSpaceError(
                errno.ENOSPC,
                f"nvme tier: the {self.kind} file {self.path} needs {format_bytes(need)} more "
                f"({format_bytes(new_size)} in all) but {self.path.parent} has only "
                f"{format_bytes(available)} free: free space there, set nvme_path to a bigger "
                "disk, or keep more chunks in host memory (param_placement / optimizer_placement)",
                str(self.path),
            )
        try:
            os.posix_fallocate(self.fd, self.size, need)
        except OSError as err:
            if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise io_error("preallocate", str(self.path), self.size, need, err.errno) from None
            os.ftruncate(self.fd, new_size)  # no fallocate here: a sparse file must do
        self.allocator.grow(new_size)

    def close(self) -> None:
        """Close and delete the file (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            self.path.unlink(missing_ok=True)


__all__ = [
    "SwapFile",
    "align_up",
    "free_bytes",
    "pid_alive",
    "remove_stale_files",
    "swap_file_name",
]
