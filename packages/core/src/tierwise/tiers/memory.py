"""Addressable tiers: the compute device and host RAM (pinned when the device is CUDA)."""

from __future__ import annotations

import torch

from tierwise.tiers.base import DONE, IOHandle, PayloadKind, Slab, Tier


class MemoryTier(Tier):
    """A tier whose slabs are plain tensors on ``self.storage_device``."""

    ADDRESSABLE = True

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
            slab.tensor = torch.empty(
                numel, dtype=dtype, device=self.storage_device, pin_memory=self.pin
            )
        except BaseException:
            self.used_bytes -= slab.nbytes
            raise
        return slab

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
        target = slab.tensor[offset : offset + src.numel()]
        target.copy_(src, non_blocking=self.pin)
        return _copy_handle(src, target, non_blocking=self.pin)


class _CopyHandle(IOHandle):
    """An asynchronous copy between pinned host memory and an accelerator.

    [Note: pinned copies]
    ``copy_(non_blocking=True)`` returns before the data has moved. Into device memory, the
    consumers are kernels: waiting makes the current stream wait for the copy. Into host memory,
    the consumer is host code (the CPU optimizer reads a gradient shard): waiting blocks the
    calling thread until the copy is done.
    """

    def __init__(self, event, to_host: bool, device: torch.device):
        self.event, self.to_host, self.device = event, to_host, device

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
    return _CopyHandle(event, dst.device.type == "cpu", accelerator)


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
