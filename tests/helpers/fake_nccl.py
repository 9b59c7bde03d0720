"""A recording fake of an NCCL-style group for CPU-only machines.

NCCL takes only tensors on the rank's CUDA device. This fake stands in for torch.distributed
under tierwise's collectives layer (``tierwise.parallel.collectives.BACKEND``): every group
reports a device of its own (``FAKE_DEVICE``, not the CPU the run computes on), a tensor counts
as on that device only when the layer put it there (``move`` / ``empty_like``: a CPU copy the
fake remembers), and every collective records the tensors it was handed and whether each was
on the group's device. Object collectives and barriers record whether the group's device was
made current. The data still moves over the real gloo group, so the run's arithmetic is
checked too. See [Note: collectives on the group's device].
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from tierwise.parallel import collectives

FAKE_DEVICE = torch.device("meta")
"""The device the fake's groups take tensors on (a marker: no tensor computes there)."""


class FakeEvent:
    """An event of the fake device's stream: done when the fake says (``complete_events``)."""

    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


class RecordingNCCL(collectives.TorchDistributed):
    def __init__(self) -> None:
        self.events_pending = False
        """Whether events recorded from now on stay pending until ``complete_events``
        (default: done at once, as on an idle stream)."""
        self.events: list[FakeEvent] = []
        self.moved_from: list[int] = []
        """Data addresses of the host tensors ``move`` copied up, in order."""
        self._on_device: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._current: torch.device | None = None
        self.phase = "setup"
        self.calls: list[tuple[str, str]] = []
        """(phase, collective) of every call, in launch order."""
        self.sequence: list[tuple[str, tuple[int, ...]]] = []
        """(collective, element counts of its tensors) of every call, in launch order: what
        ranks must agree on ([Note: one collective order])."""
        self.misplaced: list[tuple[str, str, str]] = []
        """(phase, collective, what): tensors not on the group's device, devices not current."""
        self.transfers: list[tuple[str, str, torch.dtype, int]] = []
        """(phase, "up" | "copy back" | "read", dtype, elements) of every host-to-device move,
        copy of a result back to the caller's host tensor, and host read of control data
        ([Note: control data on the device])."""

    @contextlib.contextmanager
    def installed(self):
        previous = collectives.BACKEND
        collectives.BACKEND = self
        try:
            yield self
        finally:
            collectives.BACKEND = previous

    def device(self, group, compute):
        return FAKE_DEVICE

    def move(self, tensor, device):
        assert device == FAKE_DEVICE, device
        self.transfers.append((self.phase, "up", tensor.dtype, tensor.numel()))
        self.moved_from.append(tensor.data_ptr())
        copy = tensor.detach().clone()
        self._on_device[id(copy)] = copy
        return copy

    def empty_like(self, tensor, device):
        assert device == FAKE_DEVICE, device
        out = torch.empty_like(tensor, device="cpu")
        self._on_device[id(out)] = out
        return out

    def record_event(self, device):
        assert device == FAKE_DEVICE, device
        self.events.append(FakeEvent(done=not self.events_pending))
        return self.events[-1]

    def complete_events(self) -> None:
        for event in self.events:
            event.done = True

    def is_on(self, tensor, device):
        return device == FAKE_DEVICE and self._on_device.get(id(tensor)) is tensor

    def copy_back(self, target, result):
        self.transfers.append((self.phase, "copy back", result.dtype, result.numel()))
        return super().copy_back(target, result)

    def to_list(self, tensor):
        if self._on_device.get(id(tensor)) is tensor:
            self.transfers.append((self.phase, "read", tensor.dtype, tensor.numel()))
        return super().to_list(tensor)

    @contextlib.contextmanager
    def device_context(self, device):
        previous, self._current = self._current, device
        try:
            yield
        finally:
            self._current = previous

    def _record(self, name: str, *tensors: torch.Tensor) -> None:
        self.calls.append((self.phase, name))
        self.sequence.append((name, tuple(t.numel() for t in tensors)))
        for i, tensor in enumerate(tensors):
            if self._on_device.get(id(tensor)) is not tensor:
                self.misplaced.append((self.phase, name, f"tensor {i} on {tensor.device}"))

    def _record_object(self, name: str) -> None:
        self.calls.append((self.phase, name))
        self.sequence.append((name, ()))
        if self._current != FAKE_DEVICE:
            self.misplaced.append((self.phase, name, f"current device {self._current}"))

    def all_gather_into(self, out, shard, group, async_op):
        self._record("all_gather", out, shard)
        return super().all_gather_into(out, shard, group, async_op)

    def reduce_scatter_into(self, out, full, op, group, async_op):
        self._record("reduce_scatter", out, full)
        return super().reduce_scatter_into(out, full, op, group, async_op)

    def all_reduce(self, tensor, op, group, async_op):
        self._record("all_reduce", tensor)
        return super().all_reduce(tensor, op, group, async_op)

    def all_gather_list(self, blocks, tensor, group):
        self._record("all_gather_list", tensor, *blocks)
        return super().all_gather_list(blocks, tensor, group)

    def all_to_all_single(self, out, tensor, out_splits, in_splits, group, async_op=False):
        self._record("all_to_all", out, tensor)
        return super().all_to_all_single(out, tensor, out_splits, in_splits, group, async_op)

    def all_gather_object(self, out, value, group):
        self._record_object("all_gather_object")
        return super().all_gather_object(out, value, group)

    def broadcast_object_list(self, box, src, group):
        self._record_object("broadcast_object")
        return super().broadcast_object_list(box, src, group)

    def barrier(self, group):
        self._record_object("barrier")
        return super().barrier(group)
