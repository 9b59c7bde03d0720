"""The optimizer ``tierwise.setup`` returns: the user's param groups, tierwise's chunked update.

An entry point, above the engine it drives: the arithmetic is in ``tierwise.optim``, the step
in the engine, the state dict in ``tierwise.checkpoint.rank_state``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tierwise.checkpoint.rank_state import load_rank_state, rank_state

if TYPE_CHECKING:
    from tierwise.runtime.engine import Engine


class TierwiseOptimizer(torch.optim.Optimizer):
    """Keeps the user's ``param_groups`` (lr, betas, eps, weight_decay per group; LR schedulers
    work on it) and delegates ``step``/``zero_grad`` to the engine's chunked Adam(W)."""

    def __init__(self, engine: Engine, user_optimizer: torch.optim.Optimizer):
        self._engine = engine
        self.kind = type(user_optimizer).__name__
        # share the user's group dicts: a scheduler built on either optimizer drives both
        super().__init__([{"params": []}], dict(user_optimizer.defaults))
        self.param_groups = user_optimizer.param_groups

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._engine.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._engine.zero_grad()

    def state_dict(self) -> dict:
        """This rank's pieces by parameter name (collective when model-parallel patterns
        rebuild whole-model values)."""
        return rank_state(self._engine)

    def load_state_dict(self, state_dict: dict) -> None:
        load_rank_state(self._engine, state_dict)

    def __repr__(self) -> str:
        return f"TierwiseOptimizer({self.kind}, groups={len(self.param_groups)})"
