"""When a step's optimizer updates may run during backward, and what the last step did.

[Note: speculative updates]
Updates of chunks whose optimizer states live on a storage tier may run during the backward
that finishes their gradients (LoHan's active gradient offloading), but clipping and fp16 loss
scaling need every gradient first: the clip coefficient depends on the global norm, the fp16
step is skipped when any gradient overflows. So the update runs *speculatively* with the
coefficient 1.0 (times 1/loss scale in fp16): when the global norm turns out at most
``max_norm``, ``clamp(max_norm / (norm + 1e-6), max=1)`` is exactly 1.0 and multiplying by it
changes no bit, so the speculative result is the after-backward result (Invariant 9). When the
norm is over the limit (or a gradient overflowed, or the hyper-parameters changed, or several
ranks disagree on which parameters got gradients), the step *rolls back*: the storage tiers
commit nothing of it ([Note: atomic optimizer step]), ``StepUndo`` restores step counts, loss
scaler and parameter homes, each updated chunk goes UPDATED -> ROLLED_BACK ([Note: gradient
lifecycle]), and the step redoes those updates after backward with the right coefficient (or
skips the step on an overflow). A redo needs the gradients the speculative update consumed: an
offloaded shard is written to its disk region while its update runs, whenever a rollback is
possible (clipping seen, fp16, or ``optimizer_overlap='in-backward'``).

Whether to speculate is decided once per backward (``SpeculationPolicy.decide``): only in the
last backward of a step (``tierwise.no_sync`` on the others, or ``Config.accumulation_steps``;
without either, when the previous step had one backward), and under ``"auto"`` only when the
recent norms stay below ``max_norm`` by a margin. The margin adapts: it doubles after a
rollback (speculate less), and shrinks by 10% after each kept speculation, down to 5%.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

UPDATE_MODES = ("in-backward", "speculative-kept", "rolled-back", "after-backward")
"""``stats()["optimizer_mode"]``: updates ran in backward with nothing to check; ran in
backward and the check (clip norm, fp16 overflow) kept them; ran in backward and were rolled
back and redone (or skipped: fp16 overflow); ran after backward."""

MARGIN_START = 0.1
MARGIN_MIN = 0.05
MARGIN_MAX = 1.0
NORMS_KEPT = 4


@dataclass
class SpeculationPolicy:
    """Decides whether this backward's updates run in it, and keeps the evidence."""

    overlap: str
    """``Config.optimizer_overlap``."""
    accumulation_steps: int | None = None
    """``Config.accumulation_steps``: backwards per step, when the caller says."""
    margin: float = MARGIN_START
    """The norm must stay below ``max_norm / (1 + margin)`` for "auto" to speculate."""
    norms: deque = field(default_factory=lambda: deque(maxlen=NORMS_KEPT))
    """The last steps' global gradient norms (unscaled)."""
    max_norm: float | None = None
    """The last ``max_norm`` clipped against (None: no clipping seen)."""
    clipped_last: bool = False
    """The previous step called ``clip_grad_norm_``."""
    clipped_this_step: bool = False
    previous_backwards: int | None = None
    """Backward passes of the previous step (None: no step yet)."""
    overflowed_last: bool = False
    no_sync_this_step: bool = False
    """``tierwise.no_sync`` was entered during this step (its backward is not the last)."""
    hits: int = 0
    """Speculative steps kept."""
    rollbacks: int = 0
    """Speculative steps rolled back."""

    @property
    def rollback_possible(self) -> bool:
        """Whether a speculative step may have to be redone under clipping (the gradients must
        then survive their update): clipping was seen, or this is the first step (nothing is
        known yet). fp16 steps always may (the caller adds that)."""
        return self.max_norm is not None or self.previous_backwards is None

    def last_backward(self, index: int, *, in_no_sync: bool) -> tuple[bool, str]:
        """Whether backward number ``index`` of this step (from 0) is its last."""
        if in_no_sync:
            return False, "a backward under tierwise.no_sync (more micro-batches follow)"
        if self.accumulation_steps is not None:
            if index == self.accumulation_steps - 1:
                return True, f"the last of accumulation_steps={self.accumulation_steps}"
            return False, (f"backward {index + 1} of accumulation_steps={self.accumulation_steps}")
        if self.no_sync_this_step:
            return True, "the first backward outside tierwise.no_sync"
        if index > 0:
            return False, "several backwards in this step without a hint"
        if self.overlap == "in-backward":
            return True, "optimizer_overlap='in-backward'"
        if self.previous_backwards is None:
            return False, "the first step (auto learns the pattern from it)"
        if self.previous_backwards != 1:
            return False, (
                f"the previous step had {self.previous_backwards} backwards: give "
                "tierwise.no_sync or Config.accumulation_steps to update in the last one"
            )
        return True, "the previous step had one backward"

    def decide(self, index: int, *, in_no_sync: bool) -> tuple[bool, str]:
        """Whether the updates of backward ``index`` run in it, and why."""
        if self.overlap == "after-backward":
            return False, "optimizer_overlap='after-backward'"
        if self.overlap == "auto" and self.previous_backwards is None:
            return False, "the first step (auto learns the pattern from it)"
        last, why = self.last_backward(index, in_no_sync=in_no_sync)
        if not last or self.overlap == "in-backward":
            return last, why
        if self.overflowed_last:
            return False, "the previous step overflowed (fp16)"
        if self.max_norm is not None and self.clipped_last and self.norms:
            bound = self.max_norm / (1.0 + self.margin)
            if max(self.norms) >= bound:
                return False, (
                    f"recent gradient norms (up to {max(self.norms):.4g}) reach max_norm "
                    f"{self.max_norm:.4g} within the margin {self.margin:.3g}"
                )
            return True, (
                f"recent gradient norms (up to {max(self.norms):.4g}) stay below max_norm "
                f"{self.max_norm:.4g} by more than the margin {self.margin:.3g}"
            )
        return True, why

    def next_in_backward(self) -> bool:
        """Whether the next step's last backward would update in it (as things stand)."""
        index = (self.accumulation_steps or 1) - 1
        return self.decide(index, in_no_sync=False)[0]

    def clipped(self, norm: float, max_norm: float) -> None:
        """``clip_grad_norm_`` ran this step (``norm`` unscaled)."""
        self.norms.append(norm)
        self.max_norm = max_norm
        self.clipped_this_step = True

    def end_step(self, *, backwards: int, speculated: bool, rolled_back: bool, overflow: bool):
        """The step is over: learn from it."""
        if speculated and rolled_back:
            self.rollbacks += 1
            self.margin = min(MARGIN_MAX, self.margin * 2)
        elif speculated:
            self.hits += 1
            self.margin = max(MARGIN_MIN, self.margin * 0.9)
        self.previous_backwards = backwards
        self.overflowed_last = overflow
        self.clipped_last, self.clipped_this_step = self.clipped_this_step, False
        self.no_sync_this_step = False


__all__ = ["UPDATE_MODES", "SpeculationPolicy"]
