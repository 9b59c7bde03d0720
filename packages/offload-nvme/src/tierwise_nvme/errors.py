"""Errors of the NVMe tier: every one names the file, the byte range and the errno."""

from __future__ import annotations

import errno as errno_codes
import os


class NVMeIOError(OSError):
    """A read or write of the NVMe tier failed (the message names file, offset, size, errno)."""


class NVMeSpaceError(NVMeIOError):
    """The disk holding ``nvme_path`` is (or would be) full."""


def io_error(
    op: str, path: str, offset: int, size: int, code: int, detail: str = ""
) -> NVMeIOError:
    """The exception for a failed ``op`` ("read"/"write") of ``size`` bytes at ``offset``.

    ENOSPC becomes :class:`NVMeSpaceError` with what to do about it.
    """
    what = f"nvme tier: {op} of {size} bytes at offset {offset} in {path} failed"
    reason = f"[Errno {code}] {os.strerror(code)}" + (f" ({detail})" if detail else "")
    if code == errno_codes.ENOSPC:
        return NVMeSpaceError(
            code,
            f"{what}: {reason}: the disk holding {os.path.dirname(path) or '.'} is full; free "
            "space there or set nvme_path to a bigger disk (checkpoints already written are "
            "untouched)",
            path,
        )
    return NVMeIOError(code, f"{what}: {reason}", path)


def short_io_error(op: str, path: str, offset: int, size: int, done: int) -> NVMeIOError:
    """A transfer that made no progress: ``done`` of ``size`` bytes after retrying."""
    return io_error(
        op,
        path,
        offset,
        size,
        errno_codes.EIO,
        f"short {op}: only {done} of {size} bytes transferred after retries",
    )


__all__ = ["NVMeIOError", "NVMeSpaceError", "io_error", "short_io_error"]
