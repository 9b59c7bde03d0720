"""Device facts: one spelling of the compute device, and tensors gathered from several devices.

[Note: normalised device]
``torch.device("cuda") != torch.device("cuda:0")``, and a CUDA tensor always reports its index,
so a comparison of a tensor's device with the configured one fails when the configuration says
"cuda". ``torch.device("cpu:0")`` likewise differs from the ``cpu`` every CPU tensor reports.
Setup resolves ``Config.device`` once (``normalize_device``) before the engine and the tiers
are built, so every ``tensor.device == tier.device`` in the runtime compares like with like.

[Note: one GPU per rank]
Under torchrun every rank of a node starts with CUDA device 0 current, so "cuda" resolved to the
current device would put every rank on GPU 0 (NCCL then refuses the duplicate GPU). When the
launcher says which local rank this process is (``LOCAL_RANK``), an index-less accelerator
spelling means the device of that index, as torchrun's own examples and the ``tierwise train``
app choose it; a node with fewer devices than local ranks is an error that says so (the ranks
would share a device). An explicit index ("cuda:3") is kept as given.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

_INDEXLESS = ("cpu", "meta")
"""Device types whose tensors report no index."""


def normalize_device(device: str | torch.device) -> torch.device:
    """``device`` as its tensors report it: an accelerator with its index ("cuda" → "cuda:N",
    N the current device), "cpu"/"meta" without one. An accelerator that is not available is
    returned as given (no device to ask; allocating on it fails with torch's own error)."""
    device = torch.device(device)
    if device.type in _INDEXLESS:
        return torch.device(device.type)
    if device.index is not None:
        return device
    module = getattr(torch, device.type, None)
    if module is None or not module.is_available():
        return device
    local_rank = os.environ.get("LOCAL_RANK", "").strip()
    if not local_rank:
        return torch.device(device.type, module.current_device())
    return _local_rank_device(device.type, int(local_rank), module.device_count())


def _local_rank_device(kind: str, local_rank: int, count: int) -> torch.device:
    """[Note: one GPU per rank]: ``kind:LOCAL_RANK``, or an error when the node has too few."""
    if not 0 <= local_rank < count:
        raise ValueError(
            f"device={kind!r} with LOCAL_RANK={local_rank}: this node has {count} {kind} "
            f"device(s), so ranks of the node would share one (NCCL refuses that); start at most "
            f"{count} processes per node (torchrun --nproc-per-node {count}), or give each rank "
            f"its device explicitly (device='{kind}:N', or CUDA_VISIBLE_DEVICES per rank with "
            f"device='{kind}:0')"
        )
    return torch.device(kind, local_rank)


def stack_on(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``torch.stack(tensors)`` on ``device`` when the tensors live on several devices (a
    plan may keep some chunks' gradients on the device and others on the host): the tensors of
    each device are stacked there and moved in one copy, so the result holds the same values
    in the same order whatever the devices, with one transfer per device instead of one per
    tensor."""
    device = torch.device(device)
    by_device: dict[torch.device, list[int]] = {}
    for i, tensor in enumerate(tensors):
        by_device.setdefault(tensor.device, []).append(i)
    if len(by_device) == 1 and next(iter(by_device)) == device:
        return torch.stack(list(tensors))
    ordered: list[torch.Tensor | None] = [None] * len(tensors)
    for positions in by_device.values():
        stacked = torch.stack([tensors[i] for i in positions])
        # onto a device the copy is queued; onto the host it must land before the values are read
        moved = stacked.to(device, non_blocking=device.type != "cpu")
        for i, value in zip(positions, moved.unbind(0), strict=True):
            ordered[i] = value
    return torch.stack(ordered)
