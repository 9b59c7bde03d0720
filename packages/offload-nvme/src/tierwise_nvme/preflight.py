"""Checks of ``nvme_path`` before anything is written there or allocated for it.

[Note: NVMe preflight]
A bad ``nvme_path`` used to surface as a traceback from deep inside the O_DIRECT probe or the
first swap-file write. Setup now checks, in order, before the bandwidth probe and before any
payload is allocated: the path is a directory (created when missing and its parent allows it),
a file can be created and written there, and, once the plan is known, the file system has room
for every slab the plan puts on NVMe (``NVMeTier.check_capacity``). Each failure is one line
naming the path and the fix (:class:`NVMeSetupError`, a ``ConfigError``). Slower I/O paths
(no O_DIRECT, no libaio) are said once per process and directory, in one line through the
``tierwise.nvme`` logger, not as Python warnings.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from tierwise.config import ConfigError
from tierwise.units import format_bytes

from tierwise_nvme.options import ALIGNMENT
from tierwise_nvme.swapfile import free_bytes

logger = logging.getLogger("tierwise.nvme")
_said: set[tuple[str, str]] = set()


class NVMeSetupError(ConfigError):
    """``nvme_path`` cannot hold the NVMe tier (one line: the path, the problem, the fix)."""


def say_once(directory: Path | str, message: str) -> None:
    """Log ``message`` (one line) the first time it comes up for ``directory`` in this process."""
    key = (str(directory), message)
    if key not in _said:
        _said.add(key)
        logger.warning(message)


def check_directory(path: str | os.PathLike) -> Path:
    """``path`` resolved, after checking it is (or can be made) a writable directory."""
    directory = Path(path).expanduser()
    if directory.exists() and not directory.is_dir():
        raise NVMeSetupError(
            f"nvme_path {directory} is a file, not a directory: set nvme_path to a directory on "
            "a fast local disk"
        )
    if not directory.exists():
        try:
            directory.mkdir(parents=True)
        except OSError as err:
            raise NVMeSetupError(
                f"nvme_path {directory} does not exist and cannot be created ({_reason(err)}): "
                "create it on a fast local disk, or choose another nvme_path"
            ) from None
    directory = directory.resolve()
    probe = directory / f".tierwise-write-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"\0" * ALIGNMENT)
        finally:
            os.close(fd)
    except OSError as err:
        raise NVMeSetupError(
            f"nvme_path {directory} is not writable ({_reason(err)}): choose a writable "
            "directory on a fast local disk, or fix its permissions or mount"
        ) from None
    finally:
        probe.unlink(missing_ok=True)
    return directory


def check_space(directory: Path, slab_bytes: list[int]) -> None:
    """The file system of ``directory`` has room for slabs of these sizes (each aligned)."""
    need = sum(-(-max(n, 1) // ALIGNMENT) * ALIGNMENT for n in slab_bytes)
    free = free_bytes(directory)
    if need > free:
        raise NVMeSetupError(
            f"nvme_path {directory} has {format_bytes(free)} free, the plan puts "
            f"{format_bytes(need)} on NVMe there: free space, choose a bigger disk, or keep more "
            "on the host (param_placement / optimizer_placement 'host', a larger host_memory)"
        )


def _reason(err: OSError) -> str:
    return f"[Errno {err.errno}] {err.strerror}" if err.errno else str(err)


__all__ = ["NVMeSetupError", "check_directory", "check_space", "say_once"]
