"""The warm-up trace: non-model memory measured between module accesses of the first step.

[Note: warm-up tracing]
During the warm-up step a tracer (tierwise-profiler's MemoryTracer, through the
tierwise_memory_tracer hook) measures the peak non-model memory between module accesses:
each access marks a moment. The engine's own work runs inside ``tracer.paused()`` so chunk
and staging buffers are not mistaken for activations. At the end of the warm-up backward the
measured peak replaces the profile's estimate (``profile.peak_activation_bytes``; the estimate
stays in ``estimated_peak_activation_bytes``) and the moments stay in ``memory_moments``.
On CPU the tracer is a dispatch mode, pushed when the warm-up forward begins; it must be on
the stack when ``backward()`` is called (autograd runs every node, and its end-of-backward
callback, with a copy of the thread-local state of that moment), so the end of the first
backward only closes the last moment, and the mode is popped on the caller's thread at the
next ``optimizer.step()`` or forward (popping it inside autograd would change the copy
only and leave the mode behind for good). It starts only for a forward
that records a graph; an engine whose traced forward is never followed by a backward
(set up, run forward, dropped: common in tests) would leave its mode behind, so at most one
engine traces at a time: the next engine to start tracing stops the previous one.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tierwise.profile import Profile
    from tierwise.protocols import MemoryTracer

_NOT_TRACING = nullcontext()  # reusable: entering it keeps no state

_ACTIVE: list = [None]
"""(tracer, weak reference to its WarmupTracing) of the trace running now, if any: the tracer
is held here so it is stopped even when its engine is gone."""


class WarmupTracing:
    """One engine's warm-up trace: starts the tracer at the first forward that records a graph,
    marks moments, pauses it around engine work, and ends it after the first backward."""

    def __init__(
        self, *, make_tracer: Callable[[], MemoryTracer | None] | None, profile: Profile | None
    ):
        self.make_tracer = make_tracer
        """Returns a warm-up memory tracer (from tierwise-profiler) or None; None: no trace."""
        self.profile = profile
        self.tracer: MemoryTracer | None = None
        self._ended = False
        self.memory_moments: list[tuple[str, int]] | None = None
        """Non-model bytes per moment of the warm-up step, measured."""
        self.estimated_peak_activation_bytes: int | None = None
        """The profile's estimate the measured peak replaced."""

    def maybe_start(self) -> None:
        """The warm-up forward begins: start the tracer (once, for a forward recording a graph)."""
        if (
            self.memory_moments is None
            and self.tracer is None
            and torch.is_grad_enabled()
            and self.make_tracer is not None
        ):
            _stop_other()
            self.tracer = self.make_tracer()
            if self.tracer is not None:
                self.tracer.start()
                _ACTIVE[0] = (self.tracer, weakref.ref(self))

    def mark(self, moment: str) -> None:
        if self.tracer is not None:
            self.tracer.mark(moment)

    def untraced(self) -> AbstractContextManager[None]:
        """A context in which the tracer does not count allocations (engine work)."""
        return _NOT_TRACING if self.tracer is None else self.tracer.paused()

    def end_backward(self) -> None:
        """Inside autograd's end-of-backward callback: close the last moment only."""
        if self.tracer is not None:
            self.tracer.mark("backward:end")
            self._ended = True

    def finish_if_ended(self) -> None:
        """On the caller's thread (a forward or the optimizer step): stop an ended trace."""
        if self.tracer is None or not self._ended:
            return
        self._ended = False
        moments = [m for m in self.tracer.stop() if m[0] != "stop"]
        if _ACTIVE[0] is not None and _ACTIVE[0][0] is self.tracer:
            _ACTIVE[0] = None
        self.tracer = None
        self.memory_moments = moments
        if self.profile is not None and moments:
            self.estimated_peak_activation_bytes = self.profile.peak_activation_bytes
            self.profile.peak_activation_bytes = max(b for _, b in moments)

    def stop_for_good(self) -> None:
        """Another engine starts tracing: never trace (the setup estimate stays)."""
        self.tracer = self.make_tracer = None


def _stop_other() -> None:
    if _ACTIVE[0] is not None:
        tracer, owner_ref = _ACTIVE[0]
        _ACTIVE[0] = None
        tracer.stop()
        owner = owner_ref()
        if owner is not None:
            owner.stop_for_good()
