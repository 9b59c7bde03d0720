"""Precision facts: the dtype and bytes per element of each kind of model data.

The one place core and every plugin (planner, search, profiler, engine) read them from. It
imports no torch at module level so light commands (``tierwise plan``'s argument parsing,
``Config``) stay light; :func:`compute_dtype` imports it when asked for a dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

PRECISIONS = ("bf16", "fp16", "fp32")
"""Compute precisions tierwise trains in (``Config.precision``)."""

_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}

PARAM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
"""Bytes per element of parameters and gradients in each compute precision."""

STATE_BYTES = 4
"""Bytes per element of each fp32 optimizer state (master copy, Adam exp_avg, exp_avg_sq)."""

OPTIM_STATES = ("master", "exp_avg", "exp_avg_sq")
"""The optimizer states every trainable element has, in slab order."""

OPTIM_BYTES = STATE_BYTES * len(OPTIM_STATES)
"""fp32 master + exp_avg + exp_avg_sq per trainable element."""


def check_precision(precision: str) -> str:
    """``precision`` when tierwise knows it; otherwise a one-line ValueError naming the choices."""
    if precision not in PARAM_BYTES:
        raise ValueError(f"precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
    return precision


def param_bytes(precision: str) -> int:
    """Bytes per element of parameters and gradients in ``precision``."""
    return PARAM_BYTES[check_precision(precision)]


def compute_dtype(precision: str) -> torch.dtype:
    """The torch dtype of parameters and gradients in ``precision``."""
    import torch  # here, not at module level: see the module docstring

    return getattr(torch, _DTYPE_NAMES[check_precision(precision)])


def state_dtype() -> torch.dtype:
    """The torch dtype of optimizer states and master copies (fp32 in every precision)."""
    import torch

    return torch.float32
