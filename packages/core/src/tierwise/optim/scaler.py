"""Dynamic loss scaling for fp16 (skip the step and back off on overflow)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class DynamicLossScaler:
    """torch.amp.GradScaler's policy: grow ×2 after ``growth_interval`` clean steps, halve on
    overflow (and skip that step)."""

    scale: float = 2.0**16
    """Current loss scale."""
    growth_factor: float = 2.0
    """Multiplier after ``growth_interval`` steps without overflow."""
    backoff_factor: float = 0.5
    """Multiplier on overflow."""
    growth_interval: int = 2000
    """Clean steps before growing."""
    good_steps: int = 0
    """Clean steps since the last change."""
    skipped_steps: int = 0
    """Steps skipped because of overflow, in total."""

    def update(self, *, overflow: bool) -> None:
        if overflow:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped_steps += 1
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "good_steps": self.good_steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale = state["scale"]
        self.good_steps = state["good_steps"]
        self.skipped_steps = state["skipped_steps"]
