"""StepMemoryTracer: non-model memory per moment of a real step (the engine's warm-up step).

The engine drives it::

    tracer = StepMemoryTracer(device, model_bytes=lambda: engine.model_bytes_on(device))
    tracer.start()
    ...  tracer.mark("forward:transformer.h.0")  # at each moment (operator boundary) ...
    moments = tracer.stop()   # [(moment, non_model_bytes), ...]

Each moment's value is the peak non-model memory since the previous mark (or ``start``):
what must fit on the device between those two points. ``stop`` closes the last interval as the
moment "stop".

On every device a dispatch mode counts the storages that ops allocate while the tracer runs and
that are still alive (:mod:`tierwise_profiler.live_memory`). Tensors that existed before
``start`` (parameters, chunks, the batch) are never counted; the engine runs its own chunk
allocations inside ``with tracer.paused():`` so they are not counted either.

[Note: the tracer leaves CUDA's statistics alone]
The tracer does not read CUDA's peak-memory statistics: an interval's peak from them needs
``torch.cuda.reset_peak_memory_stats`` at every mark, which clobbers the statistics the user's own
code (or a profiler around the run) is measuring. The storage count gives the same per-interval
peak of tensor memory on any device, with no device synchronisation; memory the allocator keeps
beyond live tensors (fragmentation, library workspaces) is what the planner's ``frag_factor``
allows for.
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


class StepMemoryTracer:
    """Peak non-model bytes per moment of a step on ``device`` (see the module docstring)."""

    def __init__(self, device: str | torch.device, *, model_bytes: Callable[[], int] | None = None):
        self.device = torch.device(device)
        self._model_bytes = model_bytes
        """Bytes of model data on the device (the ``tierwise_memory_tracer`` hook passes it); the
        storage count never sees model data, so it is not subtracted from anything."""
        self._mode: _LiveTensorMode | None = None
        self._moments: list[tuple[str, int]] = []
        self.peak_bytes = 0
        """Highest non-model bytes seen between ``start`` and ``stop``."""

    def start(self) -> None:
        """Begin tracing (the first interval starts now)."""
        self._moments = []
        self.peak_bytes = 0
        self._mode = _LiveTensorMode()  # [Note: the tracer leaves CUDA's statistics alone]
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
        if self._mode is None:
            raise RuntimeError("StepMemoryTracer.mark() before start(): call start() first")
        live = self._mode.live
        peak = live.peak_bytes
        live.reset_peak()
        return peak
