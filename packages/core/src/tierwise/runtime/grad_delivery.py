"""The engine's part of a parameter's gradient hook: what follows the gradient path's work.

A component of :class:`tierwise.runtime.engine.Engine` ([Note: shared runtime state]), called by
``Engine.on_grad`` once per gradient and by its end of backward. It owns no state: it hands the
chunks whose gradients became final to the optimizer step, releases the modules whose backward
is done and ends the pins of parameters read outside their module's forward.

[Note: the engine's per-gradient work]
Autograd calls the engine once per parameter per backward, so every Python call made there is
paid about a hundred times a step even on the smallest model; on a single rank with everything
on the device the hook chain was most of tierwise's own work in a step ([Note: per-module hook
cost]). What is fixed for the run is bound here once (the parts this hook talks to), the tracer's
context is entered only while a warm-up trace is being recorded (``Engine.on_grad``), and an
empty list of final chunks costs no call. The order of the work is the one the engine always
had: the gradient path, the optimizer step's final chunks, the module releases, the outside
uses.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tierwise.runtime.access.module_access import ModuleAccess
from tierwise.runtime.access.outside_use import OutsideUses
from tierwise.runtime.grads.path import GradientPath
from tierwise.runtime.step.optimizer_step import OptimizerStep


class GradDelivery:
    """Takes each gradient after the gradient path: [Note: the engine's per-gradient work]."""

    def __init__(
        self,
        *,
        gradients: GradientPath,
        optimizer: OptimizerStep,
        access: ModuleAccess,
        outside_uses: OutsideUses,
        abandon_backward: Callable[[str], None],
    ) -> None:
        self.gradients = gradients
        self.optimizer = optimizer
        self.access = access
        self.outside_uses = outside_uses
        self.abandon_backward = abandon_backward
        """The engine's ``abandon_backward``: a gradient shard's disk I/O failed."""

    def deliver(self, param: torch.nn.Parameter) -> None:
        """``param``'s gradient: the gradient path takes it; finished modules are released."""
        try:
            final = self.gradients.on_grad(param)
        except OSError as err:  # a gradient shard's disk I/O failed ([Note: active gradient
            # offloading]): the backward ends here ([Note: an abandoned backward])
            self.abandon_backward(f"{type(err).__name__}: {err}")
            raise
        if final:
            self.hand_over(final)
        self.access.release_finished_backward(param)
        self.outside_uses.on_grad(param)

    def hand_over(self, final: list) -> None:
        """Final chunks go to the optimizer step in order ([Note: speculative updates])."""
        for chunk in final:
            self.optimizer.grads_final(chunk, in_no_sync=self.gradients.in_no_sync)
