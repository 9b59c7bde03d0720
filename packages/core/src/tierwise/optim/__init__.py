"""Chunked optimizers, loss scaling."""

from tierwise.optim.adam import AdamHyper, adam_update, check_optimizer
from tierwise.optim.optimizer import TierwiseOptimizer
from tierwise.optim.scaler import DynamicLossScaler

__all__ = ["AdamHyper", "DynamicLossScaler", "TierwiseOptimizer", "adam_update", "check_optimizer"]
