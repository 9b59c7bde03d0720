"""Page-aligned host buffers (pinned when the compute device is CUDA) for O_DIRECT I/O."""

from __future__ import annotations

import torch

from tierwise_nvme.options import ALIGNMENT


def aligned_empty(nbytes: int, *, pin: bool = False) -> torch.Tensor:
    """A uint8 CPU tensor of ``nbytes`` whose first byte is ALIGNMENT-aligned.

    Over-allocates by one page and slices, so it works with any allocator (pinned or not).
    """
    raw = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8, pin_memory=pin)
    skip = -raw.data_ptr() % ALIGNMENT
    return raw[skip : skip + nbytes]


def is_aligned(tensor: torch.Tensor) -> bool:
    """True when ``tensor``'s memory starts on an ALIGNMENT boundary."""
    return tensor.data_ptr() % ALIGNMENT == 0


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 tensor sharing its memory."""
    flat = tensor.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def memoryview_of(byte_tensor: torch.Tensor) -> memoryview:
    """A writable memoryview of a flat uint8 CPU tensor (what the I/O backends take)."""
    return memoryview(byte_tensor.numpy()).cast("B")


__all__ = ["aligned_empty", "byte_view", "is_aligned", "memoryview_of"]
