"""I/O backends of the NVMe tier and the choice between them (fallbacks are said once, in one
line: [Note: NVMe preflight])."""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path

from tierwise_nvme.backends.base import IOBackend, IORequest, PieceTracker
from tierwise_nvme.backends.libaio_backend import LibaioBackend
from tierwise_nvme.backends.threads import ThreadPoolBackend
from tierwise_nvme.options import ALIGNMENT, NVMeOptions


class NVMeFallbackWarning(RuntimeWarning):
    """Kept for imports: fallbacks are now logged once (``tierwise.nvme`` logger), not warned."""


def o_direct_supported(directory: Path) -> bool:
    """Whether files in ``directory`` accept O_DIRECT opens and aligned writes (tmpfs does not)."""
    path = directory / f".tierwise-odirect-probe-{os.getpid()}"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    except OSError as err:
        if err.errno == errno.EINVAL:
            return False
        raise
    try:
        with mmap.mmap(-1, ALIGNMENT) as page:
            os.pwrite(fd, page, 0)
        return True
    except OSError as err:
        if err.errno == errno.EINVAL:
            return False
        raise
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


def open_backend(options: NVMeOptions, directory: Path) -> IOBackend:
    """The backend ``options.backend`` asks for, or the best fallback, said once in one line."""
    from tierwise_nvme.preflight import say_once

    threads = dict(block_size=options.block_size, queue_depth=options.queue_depth)
    if options.backend == "buffered":
        return ThreadPoolBackend(direct=False, **threads)
    if not o_direct_supported(directory):
        say_once(
            directory,
            f"nvme tier: the file system of {directory} refuses O_DIRECT (tmpfs or FUSE?); "
            "using buffered I/O through the page cache, which competes with training for host "
            "RAM: point nvme_path to a directory on a local disk (ext4, xfs) for direct I/O",
        )
        return ThreadPoolBackend(direct=False, **threads)
    if options.backend in ("auto", "libaio"):
        try:
            return LibaioBackend(**threads)
        except (OSError, ImportError) as err:
            say_once(
                directory,
                f"nvme tier: Linux AIO is unavailable ({err}); using a thread pool of "
                "os.preadv/os.pwritev instead: install libaio.so.1 (Debian/Ubuntu: apt-get "
                "install libaio1, or libaio1t64 on newer releases) for asynchronous kernel I/O",
            )
    return ThreadPoolBackend(direct=True, **threads)


__all__ = [
    "IOBackend",
    "IORequest",
    "LibaioBackend",
    "NVMeFallbackWarning",
    "PieceTracker",
    "ThreadPoolBackend",
    "o_direct_supported",
    "open_backend",
]
