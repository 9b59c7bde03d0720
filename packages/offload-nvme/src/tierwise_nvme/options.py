"""NVMeOptions: how the NVMe tier does I/O (backend, block size, queue depth)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from tierwise.units import parse_bytes

BACKENDS = ("auto", "libaio", "threads", "buffered")
ALIGNMENT = 4096
"""File offsets, transfer sizes and buffer addresses of O_DIRECT I/O are multiples of this."""
BOUNCE_BYTES = 256 << 20
"""Default budget of each of the tier's bounce-buffer caches, bytes (``NVMeOptions.bounce_bytes``)."""


class NVMeOptionsError(ValueError):
    """An NVMe option has a value the tier cannot use; the message says what to change."""


@dataclass(frozen=True, kw_only=True)
class NVMeOptions:
    """I/O settings of the NVMe tier. ``from_env()`` reads the ``TIERWISE_NVME_*`` variables."""

    backend: str = "auto"
    """"auto" (libaio with O_DIRECT; thread pool without libaio.so.1; buffered I/O where the
    file system refuses O_DIRECT), or force one: "libaio", "threads" (os.preadv/pwritev on
    O_DIRECT files in a thread pool), "buffered" (thread pool through the page cache).
    Env: TIERWISE_NVME_BACKEND."""

    block_size: int = 4 << 20
    """Bytes per I/O request; larger transfers are split. A multiple of 4096.
    Env: TIERWISE_NVME_BLOCK_SIZE (e.g. "1MiB")."""

    queue_depth: int = 16
    """Requests in flight at once (libaio queue depth, or thread-pool size).
    Env: TIERWISE_NVME_QUEUE_DEPTH."""

    timeout_s: float = 600.0
    """Seconds a caller waits for one transfer before giving up with an error naming it (a
    disk or driver that stopped answering must not hang training). Env: TIERWISE_NVME_TIMEOUT."""

    bounce_bytes: int = BOUNCE_BYTES
    """Most bytes of bounce buffers (page-aligned host copies for the transfers O_DIRECT cannot
    do in place) the tier holds at once, per cache (the pageable one, and on CUDA the pinned one
    of device tensors' copies); a transfer waits for room ([Note: bounded bounce buffers]). At
    least two pages. Env: TIERWISE_NVME_BOUNCE_BYTES (e.g. "64MiB")."""

    def __post_init__(self) -> None:
        if (
            isinstance(self.bounce_bytes, bool)
            or not isinstance(self.bounce_bytes, int)
            or self.bounce_bytes < 2 * ALIGNMENT
        ):
            raise NVMeOptionsError(
                f"NVMeOptions.bounce_bytes={self.bounce_bytes!r}: give at least {2 * ALIGNMENT} "
                "bytes, e.g. 256MiB"
            )
        if (
            isinstance(self.timeout_s, bool)
            or not isinstance(self.timeout_s, (int, float))
            or not self.timeout_s > 0
        ):
            raise NVMeOptionsError(
                f"NVMeOptions.timeout_s={self.timeout_s!r}: give a positive number of seconds"
            )
        if self.backend not in BACKENDS:
            raise NVMeOptionsError(
                f"NVMeOptions.backend={self.backend!r}: choose one of {', '.join(BACKENDS)}"
            )
        if (
            isinstance(self.block_size, bool)
            or not isinstance(self.block_size, int)
            or self.block_size <= 0
            or self.block_size % ALIGNMENT
        ):
            raise NVMeOptionsError(
                f"NVMeOptions.block_size={self.block_size!r}: give a positive multiple of "
                f"{ALIGNMENT} bytes, e.g. 1MiB"
            )
        if (
            isinstance(self.queue_depth, bool)
            or not isinstance(self.queue_depth, int)
            or not 1 <= self.queue_depth <= 1024
        ):
            raise NVMeOptionsError(
                f"NVMeOptions.queue_depth={self.queue_depth!r}: give a number of requests "
                "between 1 and 1024"
            )

    @classmethod
    def from_env(cls) -> NVMeOptions:
        """Defaults, overridden by TIERWISE_NVME_BACKEND / _BLOCK_SIZE / _QUEUE_DEPTH /
        _TIMEOUT / _BOUNCE_BYTES."""
        values: dict = {}
        if "TIERWISE_NVME_BACKEND" in os.environ:
            values["backend"] = os.environ["TIERWISE_NVME_BACKEND"].strip().lower()
        if "TIERWISE_NVME_BLOCK_SIZE" in os.environ:
            try:
                values["block_size"] = parse_bytes(
                    os.environ["TIERWISE_NVME_BLOCK_SIZE"], what="TIERWISE_NVME_BLOCK_SIZE"
                )
            except ValueError as err:
                raise NVMeOptionsError(str(err)) from None
        if "TIERWISE_NVME_BOUNCE_BYTES" in os.environ:
            try:
                values["bounce_bytes"] = parse_bytes(
                    os.environ["TIERWISE_NVME_BOUNCE_BYTES"], what="TIERWISE_NVME_BOUNCE_BYTES"
                )
            except ValueError as err:
                raise NVMeOptionsError(str(err)) from None
        if "TIERWISE_NVME_QUEUE_DEPTH" in os.environ:
            raw = os.environ["TIERWISE_NVME_QUEUE_DEPTH"]
            try:
                values["queue_depth"] = int(raw)
            except ValueError:
                raise NVMeOptionsError(
                    f"TIERWISE_NVME_QUEUE_DEPTH={raw!r}: give a whole number, e.g. 32"
                ) from None
        if "TIERWISE_NVME_TIMEOUT" in os.environ:
            raw = os.environ["TIERWISE_NVME_TIMEOUT"]
            try:
                values["timeout_s"] = float(raw)
            except ValueError:
                raise NVMeOptionsError(
                    f"TIERWISE_NVME_TIMEOUT={raw!r}: give a number of seconds, e.g. 600"
                ) from None
        return cls(**values)


__all__ = ["ALIGNMENT", "BACKENDS", "BOUNCE_BYTES", "NVMeOptions", "NVMeOptionsError"]
