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
from tierwise_nvme.options import ALIGNMENT, NVMeOptions, NVMeOptionsError


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


def _forced_libaio_unusable(why: str) -> NVMeOptionsError:
    return NVMeOptionsError(
        f"TIERWISE_NVME_BACKEND=libaio (NVMeOptions.backend) asks for Linux AIO with O_DIRECT, "
        f"which cannot be used here: {why}. Install libaio.so.1 (Debian/Ubuntu: apt-get install "
        "libaio1, or libaio1t64 on newer releases) and point nvme_path to a local disk (ext4, "
        "xfs), or set TIERWISE_NVME_BACKEND=auto to fall back to a thread pool"
    )


def open_backend(options: NVMeOptions, directory: Path) -> IOBackend:
    """The backend ``options.backend`` asks for, or with "auto" the best fallback, said once in
    one line; a forced "libaio" that cannot be used raises ``NVMeOptionsError``."""
    from tierwise_nvme.preflight import say_once

    threads = dict(block_size=options.block_size, queue_depth=options.queue_depth)
    if options.backend == "buffered":
        return ThreadPoolBackend(direct=False, **threads)
    if not o_direct_supported(directory):
        if options.backend == "libaio":
            raise _forced_libaio_unusable(
                f"the file system of {directory} refuses O_DIRECT (tmpfs or FUSE?)"
            )
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
            if options.backend == "libaio":
                raise _forced_libaio_unusable(f"Linux AIO is unavailable: {err}") from err
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
