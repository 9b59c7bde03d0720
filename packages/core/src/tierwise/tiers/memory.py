"""Addressable tiers: the compute device and host RAM (pinned when the device is CUDA)."""

from __future__ import annotations

import torch

from tierwise.tiers.arena import PAGE, SLAB_ALIGNMENT, PinnedArena, round_up
from tierwise.tiers.base import DONE, IOHandle, PayloadKind, Slab, Tier
from tierwise.tiers.ledger import MemoryPool, ReusedBuffers


class MemoryTier(Tier):
    """A tier whose slabs are plain tensors on ``self.storage_device``."""

    ADDRESSABLE = True

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.cast_pool = MemoryPool(
            f"{self.PLUGIN_NAME}_cast_buffers",
            memory="host",
            pinned=self.storage_device.type == "cuda",
        )
        """Host buffers of a storage-tier master's pieces read and cast on their way into this
        tier's memory, counted in the ledger ([Note: casting a master from storage]);
        page-locked on CUDA, where the device tier's are copied to the device."""
        self.cast_buffers = ReusedBuffers(self.cast_pool, keep=4)

    def memory_pools(self) -> list[MemoryPool]:
        return [self.cast_pool]

    @property
    def storage_device(self) -> torch.device:
        raise NotImplementedError

    @property
    def pin(self) -> bool:
        return False

    def allocate(
        self, numel: int, dtype: torch.dtype, *, kind: PayloadKind, what: str = ""
    ) -> Slab:
        slab = Slab(self, numel, dtype, what or kind.value, kind=kind)
        self._account(slab.nbytes, slab.what)
        try:
            slab.tensor = self._empty(slab)
        except BaseException:
            self.used_bytes -= slab.nbytes
            raise
        return slab

    def _empty(self, slab: Slab) -> torch.Tensor:
        return torch.empty(slab.numel, dtype=slab.dtype, device=self.storage_device)

    def release(self, slab: Slab) -> None:
        if slab.tensor is not None:
            self.used_bytes -= slab.nbytes
            slab.tensor = None

    def read(self, slab: Slab, out: torch.Tensor, *, offset: int = 0) -> IOHandle:
        source = slab.tensor[offset : offset + out.numel()]
        out.copy_(source, non_blocking=self.pin)
        return _copy_handle(source, out, non_blocking=self.pin)

    def write(
        self, slab: Slab, src: torch.Tensor, *, offset: int = 0, rest_is_padding: bool = False
    ) -> IOHandle:
        """[Note: writes from host memory]
        Values in host memory written into a slab on an accelerator (a device home's new values:
        [Note: CUDA threading model]) are copied with ``non_blocking=True``: from page-locked
        memory the copy is queued on the current stream and the host goes on; the handle's event
        orders it (kernels wait for it, ``done`` asks it) and the handle keeps ``src`` alive.
        Until ``done``, host code must not write ``src`` (``HomeWrites`` lends its buffer again
        only then). From pageable memory CUDA stages the source before returning, so the flag
        changes nothing there. Between two host tensors (a CPU run) the copy is synchronous."""
        target = slab.tensor[offset : offset + src.numel()]
        non_blocking = self.pin or src.device.type == "cpu"
        target.copy_(src, non_blocking=non_blocking)
        return _copy_handle(src, target, non_blocking=non_blocking)


class _CopyHandle(IOHandle):
    """An asynchronous copy between pinned host memory and an accelerator.

    [Note: pinned copies]
    ``copy_(non_blocking=True)`` returns before the data has moved. Into device memory, the
    consumers are kernels: waiting makes the current stream wait for the copy. Into host memory,
    the consumer is host code (the CPU optimizer reads a gradient shard): waiting blocks the
    calling thread until the copy is done.
    """

    def __init__(self, event, to_host: bool, device: torch.device, tensors: tuple = ()):
        self.event, self.to_host, self.device = event, to_host, device
        self.tensors = tensors
        """The copy's source and target, kept alive while the handle is."""

    def wait(self) -> None:
        if self.to_host:
            self.event.synchronize()
        else:
            torch.accelerator.current_stream(self.device).wait_event(self.event)

    def done(self) -> bool:
        return self.event.query()


def _copy_handle(src: torch.Tensor, dst: torch.Tensor, *, non_blocking: bool) -> IOHandle:
    accelerator = next((t.device for t in (src, dst) if t.device.type not in ("cpu", "meta")), None)
    if not non_blocking or accelerator is None:
        return DONE
    event = torch.accelerator.current_stream(accelerator).record_event()
    return _CopyHandle(event, dst.device.type == "cpu", accelerator, (src, dst))


class DeviceTier(MemoryTier):
    """The compute device (on a CPU-only machine: host RAM under the device budget)."""

    PLUGIN_NAME = "device"

    @property
    def storage_device(self) -> torch.device:
        return self.device


class HostTier(MemoryTier):
    """Host RAM; pinned when the compute device is CUDA so copies can overlap compute."""

    PLUGIN_NAME = "host"

    @property
    def storage_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def pin(self) -> bool:
        return self.device.type == "cuda"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.arena = PinnedArena() if self.pin else None
        self.arena_pool = MemoryPool("pinned_arena", memory="host", pinned=True, within="host")
        """The arena's registered bytes in the ledger (counted whole in this tier)."""

    def memory_pools(self) -> list[MemoryPool]:
        return [self.cast_pool] + ([self.arena_pool] if self.arena is not None else [])

    def check_capacity(self, slab_bytes: list[int]) -> None:
        """On CUDA: the arena is sized for the slabs setup is about to allocate, once
        ([Note: one pinned arena])."""
        if self.arena is not None and self.arena.registrations == 0:
            nbytes = sum(round_up(max(n, 1), SLAB_ALIGNMENT) for n in slab_bytes)
            if nbytes:
                self._grow(round_up(nbytes, PAGE))

    def allocate(
        self, numel: int, dtype: torch.dtype, *, kind: PayloadKind, what: str = ""
    ) -> Slab:
        """[Note: page-locked slabs]
        On CUDA a host slab is page-locked so its copies overlap compute. It is not taken from
        PyTorch's pinned allocator (``pin_memory=True``), which rounds every block up to a power
        of two and keeps freed blocks for later pinned allocations: ``host_memory`` would count
        up to half of what is really locked. Slabs are slices of the tier's one registered
        arena, and the arena is counted whole ([Note: one pinned arena])."""
        if self.arena is None:
            return super().allocate(numel, dtype, kind=kind, what=what)
        slab = Slab(self, numel, dtype, what or kind.value, kind=kind)
        nbytes = round_up(max(slab.nbytes, 1), SLAB_ALIGNMENT)
        place = self.arena.take(nbytes)
        if place is None:
            self._grow(self.arena.extent_bytes(nbytes), what=slab.what)
            place = self.arena.take(nbytes)
        slab.extra["arena"] = (*place, nbytes)
        slab.tensor = self.arena.view(*place, slab.nbytes).view(dtype)
        return slab

    def _grow(self, nbytes: int, what: str = "the pinned arena") -> None:
        self._account(nbytes, what)  # counted whole, when locked
        try:
            self.arena.grow(nbytes)
        except BaseException:
            self.used_bytes -= nbytes
            raise
        self.arena_pool.observe(self.arena.registered_bytes)

    def release(self, slab: Slab) -> None:
        place = slab.extra.pop("arena", None)
        if place is None:
            return super().release(slab)
        if slab.tensor is not None:
            self.arena.give(*place)  # its room stays locked and counted
            slab.tensor = None

    def close(self) -> None:
        if self.arena is not None:
            self.arena.close()
