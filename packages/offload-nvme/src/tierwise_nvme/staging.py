"""StagingPool: a bounded set of reusable page-aligned host buffers for NVMe transfers.

Two kinds of pools: the optimizer pipeline's (one buffer per optimizer state of a chunk: read,
updated in place, written back), and each NVMe tier's pool for staged reads (block-sized
buffers that carry reads into destinations O_DIRECT cannot fill in place, such as rCache
chunks; see [Note: staged reads]). Page alignment lets the tier move them with O_DIRECT
without bounce copies (see [Note: unaligned transfers]); on CUDA they are pinned so
host->device copies overlap compute. A pool never holds more than ``count`` buffers: when all
are lent, ``acquire`` waits for a release (or returns None) instead of allocating more.

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
from tierwise.parallel.timeouts import waited_too_long
from tierwise.planning.host_share import rank_host_share
from tierwise.probe import available_host_memory, ranks_on_this_node
from tierwise.tiers.arena import PAGE, round_up
from tierwise.tiers.ledger import MemoryPool
from tierwise.units import format_bytes

from tierwise_nvme.buffers import aligned_empty

if TYPE_CHECKING:
    from tierwise.config import Config

HOST_FRACTION = 0.125
"""At most this fraction of available host RAM (or of the host_memory budget) goes to one
staging pool."""


def host_bytes(
    config: Config, host_memory: int | None = None, *, ranks_per_node: int | None = None
) -> int | None:
    """The host memory a staging pool is sized against: ``host_memory`` if given, else the
    smaller of Config.host_memory (the rank's share already: setup and the planners pass
    ``rank_config``) and the rank's share of the RAM available now (None when neither is
    known). ``ranks_per_node``: the node's ranks sharing that RAM, the plan's hardware's at
    plan time; None (a tier being made) counts them as the probe does ([Note: a rank's host
    share]), so plan and run size the pools alike."""
    if host_memory is not None:
        return host_memory
    ranks = ranks_per_node if ranks_per_node is not None else ranks_on_this_node()
    available = rank_host_share(available_host_memory(), ranks)
    known = [b for b in (config.host_memory, available) if b is not None]
    return min(known) if known else None


def read_pool_count(*, block_size: int, queue_depth: int, host: int | None) -> int:
    """Buffers of an NVMe tier's staged-read pool (see ``StagingPool.for_reads``)."""
    wanted = queue_depth + 2
    count = wanted if host is None else min(wanted, int(host * HOST_FRACTION) // block_size)
    return max(1, count)


class StagingPool:
    """``count`` buffers of ``buffer_bytes`` each, allocated on first use and then reused."""

    def __init__(
        self,
        *,
        buffer_bytes: int,
        count: int,
        pin: bool = False,
        memory: MemoryPool | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        if buffer_bytes <= 0 or count <= 0:
            raise ValueError(
                f"StagingPool needs buffer_bytes > 0 and count > 0, got {buffer_bytes} and {count}"
            )
        self.buffer_bytes = buffer_bytes
        self.count = count
        self.pin = pin
        self.memory = memory or MemoryPool(
            "nvme_staging",
            memory="host",
            pinned=pin,
            budget=count * (round_up(buffer_bytes, PAGE) + (0 if pin else PAGE)),
            within="host",
        )
        """The ledger pool its buffers are allocated through ([Note: the memory ledger]); the
        tier's ``host_buffer_bytes`` reserves them in the host tier."""
        self.timeout_s = timeout_s
        """Seconds ``acquire`` waits for a buffer to come back ([Note: bounded waits])."""
        self._buffers: list[torch.Tensor] = []
        self._free: list[torch.Tensor] = []
        self._lent: dict[int, torch.Tensor] = {}  # data_ptr -> buffer
        self._cond = threading.Condition()
        self.peak_lent = 0
        """The most buffers lent at once so far (never more than ``count``)."""

    @classmethod
    def for_chunks(
        cls, *, chunk_bytes: int, config: Config, host_memory: int | None = None
    ) -> StagingPool:
        """A pool sized from the plan: ``prefetch`` chunks read ahead, one in use and one being
        written back (at least 3, for the read/update/write pipeline), but never more than
        HOST_FRACTION of the host memory (Config.host_memory or what is available; never fewer
        than 2 buffers)."""
        wanted = max(3, config.prefetch + 2)
        host = host_bytes(config, host_memory)
        count = wanted if host is None else min(wanted, int(host * HOST_FRACTION) // chunk_bytes)
        if count < 2:
            raise MemoryError(
                f"nvme staging: two buffers of one chunk ({format_bytes(chunk_bytes)}) exceed "
                f"{HOST_FRACTION:.0%} of the host memory ({format_bytes(host or 0)}): use a "
                "smaller chunk_size or free host memory"
            )
        return cls(
            buffer_bytes=chunk_bytes, count=count, pin=torch.device(config.device).type == "cuda"
        )

    @classmethod
    def for_reads(
        cls, *, block_size: int, queue_depth: int, config: Config, host_memory: int | None = None
    ) -> StagingPool:
        """The pool of an NVMe tier's staged reads: one ``block_size`` buffer per request the
        tier keeps in flight (``queue_depth``) plus two being copied out, so the disk stays as
        busy as fio with the same block size and queue depth; never more than HOST_FRACTION of
        the host memory (Config.host_memory or what is available), and at least one buffer.
        A chunk's size does not matter: staged reads stream through the pool block by block.
        """
        return cls(
            buffer_bytes=block_size,
            count=read_pool_count(
                block_size=block_size, queue_depth=queue_depth, host=host_bytes(config, host_memory)
            ),
            pin=torch.device(config.device).type == "cuda",
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
                if not self._cond.wait(timeout=self.timeout_s):  # [Note: bounded waits]
                    raise waited_too_long(
                        f"a staging buffer to come back ({len(self._lent)} of {self.count} lent)",
                        self.timeout_s,
                    )
            if self._free:
                buffer = self._free.pop()
            else:
                buffer = aligned_empty(self.buffer_bytes, pool=self.memory)
                self._buffers.append(buffer)
            view = buffer[:nbytes].view(dtype)
            self._lent[view.data_ptr()] = buffer
            self.peak_lent = max(self.peak_lent, len(self._lent))
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
    def allocated(self) -> int:
        """Buffers allocated so far (never more than ``count``)."""
        with self._cond:
            return len(self._buffers)

    @property
    def allocated_bytes(self) -> int:
        """Host bytes held by the buffers allocated so far."""
        return self.allocated * self.buffer_bytes


__all__ = ["HOST_FRACTION", "StagingPool", "host_bytes", "read_pool_count"]
