"""Chunked optimizers, loss scaling."""

from tierwise.optim.adam import (
    AdamHyper,
    adam_update,
    adam_update_ranges,
    adam_update_tensors,
    check_optimizer,
)
from tierwise.optim.scaler import DynamicLossScaler
from tierwise.optim.step_counts import StepCounts

__all__ = [
    "AdamHyper",
    "DynamicLossScaler",
    "StepCounts",
    "adam_update",
    "adam_update_ranges",
    "adam_update_tensors",
    "check_optimizer",
]
