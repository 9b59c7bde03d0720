"""StepUndo: puts back what a failed optimizer step changed besides the storage-tier states.

Storage tiers with ``STATE_COPIES`` 2 commit a step's optimizer states only once every chunk's
write is complete ([Note: atomic optimizer step], tierwise_nvme.optimizer_pipeline). When the
step fails before that commit, the states are still the last step's; this component restores
the rest to match: the per-parameter step counts, the loss scaler, and the low-precision
parameter homes that updates already overwrote (recomputed from the committed fp32 masters,
exactly as an update computes them).
"""

from __future__ import annotations

import torch

from tierwise.chunks import Chunk
from tierwise.optim.scaler import DynamicLossScaler
from tierwise.optim.step_counts import StepCounts


class StepUndo:
    """Snapshots taken when a step begins changing state; ``restore`` or ``clear`` ends it."""

    def __init__(self, *, step_counts: StepCounts, scaler: DynamicLossScaler | None) -> None:
        self.step_counts = step_counts
        self.scaler = scaler
        self._counts: dict | None = None
        self._scaler: dict | None = None
        self._homes: list[Chunk] = []

    def begin(self) -> None:
        """Called before the step changes anything (again: a no-op until ``clear``)."""
        if self._counts is None:
            self._counts = self.step_counts.state_dict()
            self._scaler = self.scaler.state_dict() if self.scaler is not None else None

    @property
    def active(self) -> bool:
        """The step began and has not committed: ``restore`` can undo it."""
        return self._counts is not None

    def home_written(self, chunk: Chunk) -> None:
        """``chunk``'s parameter home is about to get this step's values (any thread); after
        the commit (not active) there is nothing to undo."""
        if self.active:
            self._homes.append(chunk)

    def clear(self) -> None:
        """The step committed (or never began): nothing to undo."""
        self._counts = self._scaler = None
        self._homes = []

    def restore(self) -> None:
        """Put back the step counts, the scaler and every overwritten home (raises OSError when
        the storage fails again: then the state is not the last step's)."""
        if self._counts is not None:
            self.step_counts.load_state_dict(self._counts)
        if self._scaler is not None:
            self.scaler.load_state_dict(self._scaler)
        for chunk in dict.fromkeys(self._homes):
            master = torch.empty(chunk.optim.master.numel, dtype=torch.float32)
            chunk.optim.tier.read(chunk.optim.master, master).wait()
            chunk.home.tier.write(chunk.home, master.to(chunk.home.dtype)).wait()
        self.clear()


__all__ = ["StepUndo"]
