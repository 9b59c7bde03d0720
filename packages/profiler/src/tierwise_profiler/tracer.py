"""MemoryTracer: non-model memory per moment of a real step (the engine's warm-up step).

The engine drives it::

    tracer = MemoryTracer(device, model_bytes=lambda: engine.model_bytes_on(device))
    tracer.start()
    ...  tracer.mark("forward:transformer.h.0")  # at each moment (operator boundary) ...
    moments = tracer.stop()   # [(moment, non_model_bytes), ...]

Each moment's value is the peak non-model memory since the previous mark (or ``start``):
what must fit on the device between those two points. ``stop`` closes the last interval as the
moment "stop".

- CUDA: ``torch.cuda.max_memory_allocated`` over the interval minus ``model_bytes()`` (the
  bytes of model data, i.e. chunks, the engine holds on the device at the mark).
- CPU: no allocator statistics exist, so a dispatch mode counts the storages that ops allocate
  while the tracer runs and that are still alive (:mod:`tierwise_profiler.live_memory`). Tensors
  that existed before ``start`` are never counted; the engine runs its own chunk allocations
  inside ``with tracer.paused():`` so they are not counted either. ``model_bytes`` is not used.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tierwise_profiler.live_memory import LiveBytes, op_tensors, storage_keys


class _LiveTensorMode(TorchDispatchMode):
    """Counts storages allocated by ops (see [Note: live storages])."""

    def __init__(self) -> None:
        super().__init__()
        self.live = LiveBytes()
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.paused:
            self.live.add_outputs(
                storage_keys(op_tensors(args, kwargs.values())), op_tensors((out,))
            )
        return out


class MemoryTracer:
    """Peak non-model bytes per moment of a step on ``device`` (see the module docstring)."""

    def __init__(self, device: str | torch.device, *, model_bytes: Callable[[], int] | None = None):
        self.device = torch.device(device)
        if self.device.type == "cuda" and model_bytes is None:
            raise ValueError(
                "MemoryTracer on cuda needs model_bytes: a callable returning the bytes of model "
                "data (chunks) the engine holds on the device, to subtract from the allocator's count"
            )
        self._model_bytes = model_bytes
        self._mode: _LiveTensorMode | None = None
        self._moments: list[tuple[str, int]] = []
        self.peak_bytes = 0
        """Highest non-model bytes seen between ``start`` and ``stop``."""

    def start(self) -> None:
        """Begin tracing (the first interval starts now)."""
        self._moments = []
        self.peak_bytes = 0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._mode = _LiveTensorMode()
            self._mode.__enter__()

    def mark(self, moment: str) -> None:
        """Close the current interval under the name ``moment`` and start the next one."""
        value = self._interval_peak()
        self._moments.append((moment, value))
        self.peak_bytes = max(self.peak_bytes, value)

    def stop(self) -> list[tuple[str, int]]:
        """Stop tracing; return ``[(moment, non_model_bytes), ...]`` including "stop"."""
        self.mark("stop")
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode.live.close()
            self._mode = None
        return list(self._moments)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Ops inside are not traced (CPU): use it around the engine's own chunk allocations."""
        if self._mode is None:
            yield
            return
        self._mode.paused = True
        try:
            yield
        finally:
            self._mode.paused = False

    def _interval_peak(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) - self._model_bytes()
            torch.cuda.reset_peak_memory_stats(self.device)
            return max(0, int(peak))
        if self._mode is None:
            raise RuntimeError("MemoryTracer.mark() before start(): call start() first")
        live = self._mode.live
        peak = live.peak_bytes
        live.reset_peak()
        return peak
