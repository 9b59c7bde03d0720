"""A guard for [Note: CUDA threading model]: fails when a thread other than the main one reads
or writes device memory.

On a CPU the device tier's memory stands in for device memory (setup with ``device="cpu"`` puts
the compute tier, its parameter homes and rCache blocks, in host RAM, where a worker's touch
would go unnoticed): every slab the device tier allocates is marked until it is released, by
its storage's identity (not its data's address, which changes when a reduction block's memory
is given back between backwards and taken again). On a GPU a tensor on a non-CPU device counts as device memory too. The
guard patches the ``torch.Tensor`` methods that read or write a tensor's values from Python
(copies, conversions, host reads, in-place arithmetic); a call on a worker thread whose tensor
(or any tensor argument) is device memory is recorded with the thread's name, the method and
the caller. Calls through the tensor methods' own C++ code are not seen: the runtime calls
these methods from Python, so what a worker does is.
"""

from __future__ import annotations

import functools
import threading
import traceback

import torch
from tierwise.tiers.memory import DeviceTier

TOUCHING = (
    "copy_",
    "to",
    "cpu",
    "cuda",
    "item",
    "tolist",
    "numpy",
    "__bool__",
    "__float__",
    "__int__",
    "clone",
    "add_",
    "mul_",
    "div_",
    "sub_",
    "zero_",
    "fill_",
    "__setitem__",
    "pin_memory",
)
"""``torch.Tensor`` methods that read or write a tensor's values."""


class ThreadGuard:
    """Records worker-thread touches of device memory (``violations``); see the module."""

    def __init__(self) -> None:
        self.device_storages: set[int] = set()
        """Storage identities (``_cdata``) of the device tier's live slabs."""
        self.violations: list[str] = []
        self.worker_calls = 0
        """Guarded calls made on worker threads (a test checks that workers ran)."""
        self.main = threading.main_thread()

    def is_device(self, tensor: torch.Tensor) -> bool:
        if tensor.device.type not in ("cpu", "meta"):
            return True
        try:
            storage = tensor.untyped_storage()._cdata
        except RuntimeError:  # no storage (a tensor subclass or a functional wrapper)
            return False
        return storage in self.device_storages

    def _check(self, name: str, args: tuple) -> None:
        if threading.current_thread() is self.main:
            return
        self.worker_calls += 1
        for arg in args:
            if isinstance(arg, torch.Tensor) and self.is_device(arg):
                caller = traceback.extract_stack(limit=4)[0]
                self.violations.append(
                    f"{threading.current_thread().name}: Tensor.{name} on device memory "
                    f"({caller.filename}:{caller.lineno} {caller.name})"
                )
                return

    def install(self, monkeypatch) -> ThreadGuard:
        guard = self
        for name in TOUCHING:
            original = getattr(torch.Tensor, name)

            @functools.wraps(original)  # a torch-function mode sees the method's own name
            def patched(self, *args, _name=name, _original=original, **kwargs):
                guard._check(_name, (self, *args, *kwargs.values()))
                return _original(self, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, patched)
        allocate, release = DeviceTier.allocate, DeviceTier.release

        def marked_allocate(tier, *args, **kwargs):
            slab = allocate(tier, *args, **kwargs)
            guard.device_storages.add(slab.tensor.untyped_storage()._cdata)
            return slab

        def unmarked_release(tier, slab):
            if slab.tensor is not None:
                guard.device_storages.discard(slab.tensor.untyped_storage()._cdata)
            return release(tier, slab)

        monkeypatch.setattr(DeviceTier, "allocate", marked_allocate)
        monkeypatch.setattr(DeviceTier, "release", unmarked_release)
        return self
