"""The phase of a training step: one ``TrainingState`` and the module pins that belong to a phase.

[Note: training phases]
A step goes FORWARD (the root module's pre-forward hook) -> BACKWARD (the first gradient or
module backward hook autograd runs; the engine's ``end_backward`` is queued on autograd then)
-> IDLE (that callback ran, or the backward was abandoned: [Note: an abandoned backward]); the
optimizer step ends it (``end_step``). Several forward/backward pairs may run in one step
(gradient accumulation), and a checkpointed block's forward runs again inside BACKWARD. The
engine reads the phase here and nowhere else keeps a copy of it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import Enum

import torch


class TrainingState(Enum):
    IDLE = "idle"
    """Before the first forward, between a backward and the optimizer step, after a step."""
    FORWARD = "forward"
    """A forward pass runs (or ran and its backward has not begun)."""
    BACKWARD = "backward"
    """Autograd runs a backward; the end-of-backward callback is queued."""


class Phases:
    """The step's phase, the modules pinned for backward and for a re-forward, and the step's
    timing."""

    def __init__(self, *, on_backward_end: Callable[[], None]):
        self.state = TrainingState.IDLE
        self._on_backward_end = on_backward_end
        self.backward_pins: set[torch.nn.Module] = set()
        """Modules fetched for their backward and not released yet."""
        self.reforward_pins: list[torch.nn.Module] = []
        """Modules a checkpoint re-forward fetched inside this backward (released by their
        post-forward hook, or at the next module backward when torch stopped the re-forward)."""
        self.backwards_this_step = 0
        """Backward passes completed since the last optimizer step."""
        self._step_started: float | None = None

    @property
    def in_backward(self) -> bool:
        return self.state is TrainingState.BACKWARD

    def begin_forward(self) -> None:
        """The root module's forward begins (the step's clock starts at its first forward)."""
        if self._step_started is None:
            self._step_started = time.perf_counter()
        if self.state is not TrainingState.BACKWARD:
            self.state = TrainingState.FORWARD

    def enter_backward(self) -> None:
        """A backward hook ran: the first one of a backward queues the end-of-backward call."""
        if self.state is not TrainingState.BACKWARD:
            self.state = TrainingState.BACKWARD
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)

    def end_backward(self) -> None:
        """Autograd finished the backward (the queued callback runs this first)."""
        self.state = TrainingState.IDLE
        self.backwards_this_step += 1
        self._clear_backward()

    def abandon_backward(self) -> None:
        """The backward stopped on an error ([Note: an abandoned backward])."""
        self.state = TrainingState.IDLE
        self._clear_backward()

    def _clear_backward(self) -> None:
        self.backward_pins.clear()
        self.reforward_pins.clear()

    def end_step(self) -> float | None:
        """The optimizer step is over (taken, skipped on overflow, or undone): seconds since
        the step's first forward (None when no forward ran)."""
        self.backwards_this_step = 0
        started, self._step_started = self._step_started, None
        return None if started is None else time.perf_counter() - started
