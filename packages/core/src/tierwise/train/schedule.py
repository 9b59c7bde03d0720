"""Learning rate: linear warmup, then cosine decay to a floor, as a torch LambdaLR."""

from __future__ import annotations

import math

import torch


def lr_factor(step: int, *, warmup: int, total: int, floor: float) -> float:
    """The multiplier of the peak learning rate for optimizer step ``step`` (0-based).

    Rises linearly from 1/(warmup+1) to 1 over ``warmup`` steps, then follows a cosine from 1
    down to ``floor`` at step ``total - 1`` and stays there.
    """
    if step < warmup:
        return (step + 1) / (warmup + 1)
    decay_steps = max(1, total - 1 - warmup)
    progress = min(1.0, (step - warmup) / decay_steps)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine(
    optimizer: torch.optim.Optimizer, *, warmup: int, total: int, floor: float = 0.1
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over ``optimizer`` following :func:`lr_factor`."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, warmup=warmup, total=total, floor=floor)
    )
