"""StagingPool: a bounded set of reusable page-aligned host buffers for NVMe transfers.

The engine reads NVMe-resident chunks ahead of use into these buffers (then copies them into
rCache or updates them in place), and writes updated chunks back from them. Page alignment
lets the tier move them with O_DIRECT without bounce copies (see [Note: unaligned transfers]);
on CUDA they are pinned so host->device copies overlap compute.

Usage::

    pool = StagingPool.for_chunks(chunk_bytes=plan.chunk_size * 4, config=config)
    buf = pool.acquire(numel, torch.float32)    # blocks while every buffer is in use
    tier.read(slab, buf).wait()
    ...                                         # use buf
    pool.release(buf)                           # after any write from buf has been waited on
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import torch
from tierwise.probe import available_host_memory
from tierwise.units import format_bytes

from tierwise_nvme.buffers import aligned_empty

if TYPE_CHECKING:
    from tierwise.config import Config

HOST_FRACTION = 0.125
"""At most this fraction of available host RAM goes to staging buffers."""


class StagingPool:
    """``count`` buffers of ``buffer_bytes`` each, allocated on first use and then reused."""

    def __init__(self, *, buffer_bytes: int, count: int, pin: bool = False) -> None:
        if buffer_bytes <= 0 or count <= 0:
            raise ValueError(
                f"StagingPool needs buffer_bytes > 0 and count > 0, got {buffer_bytes} and {count}"
            )
        self.buffer_bytes = buffer_bytes
        self.count = count
        self.pin = pin
        self._buffers: list[torch.Tensor] = []
        self._free: list[torch.Tensor] = []
        self._lent: dict[int, torch.Tensor] = {}  # data_ptr -> buffer
        self._cond = threading.Condition()

    @classmethod
    def for_chunks(
        cls, *, chunk_bytes: int, config: Config, host_memory: int | None = None
    ) -> StagingPool:
        """A pool sized from the plan: ``prefetch`` chunks read ahead, one in use and one being
        written back (at least 3, for the read/update/write pipeline), but never more than
        HOST_FRACTION of available host RAM (and never fewer than 2 buffers)."""
        wanted = max(3, config.prefetch + 2)
        host = host_memory if host_memory is not None else available_host_memory()
        count = wanted if host is None else min(wanted, int(host * HOST_FRACTION) // chunk_bytes)
        if count < 2:
            raise MemoryError(
                f"nvme staging: two buffers of one chunk ({format_bytes(chunk_bytes)}) exceed "
                f"{HOST_FRACTION:.0%} of available host RAM ({format_bytes(host or 0)}): use a "
                "smaller chunk_size or free host memory"
            )
        return cls(
            buffer_bytes=chunk_bytes, count=count, pin=torch.device(config.device).type == "cuda"
        )

    def acquire(self, numel: int, dtype: torch.dtype, *, block: bool = True) -> torch.Tensor | None:
        """A tensor of ``numel`` ``dtype`` elements in a free buffer (contents undefined).

        Blocks until a buffer is released when all are lent (None instead if ``block`` is False).
        """
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes > self.buffer_bytes:
            raise ValueError(
                f"nvme staging: {numel} {dtype} elements ({format_bytes(nbytes)}) exceed the "
                f"buffer size {format_bytes(self.buffer_bytes)}"
            )
        with self._cond:
            while not self._free and len(self._buffers) == self.count:
                if not block:
                    return None
                self._cond.wait()
            if self._free:
                buffer = self._free.pop()
            else:
                buffer = aligned_empty(self.buffer_bytes, pin=self.pin)
                self._buffers.append(buffer)
            view = buffer[:nbytes].view(dtype)
            self._lent[view.data_ptr()] = buffer
            return view

    def release(self, tensor: torch.Tensor) -> None:
        """Return a tensor from ``acquire`` to the pool."""
        with self._cond:
            buffer = self._lent.pop(tensor.data_ptr(), None)
            if buffer is None:
                raise ValueError("nvme staging: release of a tensor that is not lent by this pool")
            self._free.append(buffer)
            self._cond.notify()

    @property
    def lent(self) -> int:
        """Buffers currently acquired."""
        with self._cond:
            return len(self._lent)

    @property
    def allocated_bytes(self) -> int:
        """Host bytes held by the buffers allocated so far."""
        return len(self._buffers) * self.buffer_bytes


__all__ = ["HOST_FRACTION", "StagingPool"]
