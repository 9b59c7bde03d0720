"""Live-tensor accounting: bytes of tensor storages alive right now, and the peak.

[Note: live storages] An op allocates when one of its outputs has a storage that none of its
inputs has (views, in-place and ``out=`` results share an input's storage). Such a storage is
counted once, and uncounted when it dies: a weakref callback on the storage's Python object fires
when the C++ storage is freed (torch keeps one Python object per storage for as long as the
storage lives). So tensors that existed before counting started (parameters, chunks, buffers, the
input batch) are never counted, whatever views of them the step makes. This works the same for
real, meta and fake tensors, which is what lets the meta profile and the CPU runtime tracer share
it.
"""

from __future__ import annotations

import weakref
from collections.abc import Container, Iterable, Iterator
from dataclasses import dataclass, field

import torch


@dataclass(kw_only=True)
class LiveStorage:
    """One counted storage."""

    nbytes: int
    """Its size in bytes."""
    owner: str
    """Who created it (a module name, or "" for code outside any module)."""


@dataclass
class LiveBytes:
    """Counts storages of tensors handed to :meth:`add` until they die; tracks the peak."""

    live_bytes: int = 0
    """Bytes of counted storages alive now."""
    peak_bytes: int = 0
    """Highest ``live_bytes`` since construction or the last :meth:`reset_peak`."""
    _live: dict[int, LiveStorage] = field(default_factory=dict)
    _refs: dict[int, weakref.ref] = field(default_factory=dict)

    def add_outputs(
        self, input_keys: Container[int], outputs: Iterable[torch.Tensor], *, owner: str = ""
    ) -> None:
        """Count the storages an op allocated: those of ``outputs`` whose ``id`` is not among
        ``input_keys`` (the ids of its inputs' storages, see :func:`storage_keys`)."""
        for tensor in outputs:
            storage = tensor.untyped_storage()
            if id(storage) not in input_keys:
                self._add(storage, owner)

    def _add(self, storage: torch.UntypedStorage, owner: str) -> None:
        key = id(storage)
        if key in self._live:
            return
        nbytes = storage.nbytes()
        self._live[key] = LiveStorage(nbytes=nbytes, owner=owner)
        self._refs[key] = weakref.ref(storage, lambda _ref, key=key: self._died(key))
        self.live_bytes += nbytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes

    def _died(self, key: int) -> None:
        entry = self._live.pop(key, None)
        self._refs.pop(key, None)
        if entry is not None:
            self.live_bytes -= entry.nbytes

    def reset_peak(self) -> None:
        """Start a new peak window at the current live bytes."""
        self.peak_bytes = self.live_bytes

    def alive(self) -> list[LiveStorage]:
        """The counted storages alive now."""
        return list(self._live.values())

    def close(self) -> None:
        """Stop watching: drop the weak references (their callbacks will not fire)."""
        self._refs.clear()
        self._live.clear()


def storage_keys(tensors: Iterable[torch.Tensor]) -> dict[int, None]:
    """The ids of the storages of ``tensors``, in order, without repeats."""
    return dict.fromkeys(id(t.untyped_storage()) for t in tensors)


def op_tensors(*groups) -> Iterator[torch.Tensor]:
    """The tensors among op arguments or results (one level of list/tuple nesting, as aten has)."""
    for group in groups:
        for item in group:
            if isinstance(item, torch.Tensor):
                yield item
            elif isinstance(item, (list, tuple)):
                for inner in item:
                    if isinstance(inner, torch.Tensor):
                        yield inner
