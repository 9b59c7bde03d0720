"""Addressable tiers: the compute device and host RAM (pinned when the device is CUDA)."""

from __future__ import annotations

import torch

from tierwise.tiers.base import DONE, IOHandle, Slab, Tier


class MemoryTier(Tier):
    """A tier whose slabs are plain tensors on ``self.storage_device``."""

    ADDRESSABLE = True

    @property
    def storage_device(self) -> torch.device:
        raise NotImplementedError

    @property
    def pin(self) -> bool:
        return False

    def allocate(self, numel: int, dtype: torch.dtype, *, what: str) -> Slab:
        slab = Slab(self, numel, dtype, what)
        self._account(slab.nbytes, what)
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
        out.copy_(slab.tensor[offset : offset + out.numel()], non_blocking=self.pin)
        return DONE

    def write(self, slab: Slab, src: torch.Tensor, *, offset: int = 0) -> IOHandle:
        slab.tensor[offset : offset + src.numel()].copy_(src, non_blocking=self.pin)
        return DONE


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
