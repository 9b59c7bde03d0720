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
"""fp32 master + exp_avg + exp_avg_sq per trainable element (``optimizer_states="fp32"``)."""

STATE_PRECISIONS = ("fp32", "bf16", "int8")
"""Precisions the Adam moments may be stored in (``Config.optimizer_states``); the master copy
stays fp32 in every one ([Note: low-bit optimizer states])."""

QUANT_BLOCK = 256
"""Elements per block of int8 moments: each block of a chunk's shard has one fp32 scale."""

MOMENT_BYTES = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0 + 4.0 / QUANT_BLOCK}
"""Bytes per element of each Adam moment in each state precision (int8: a code, plus a block's
fp32 scale shared by QUANT_BLOCK elements)."""


def optim_bytes(optimizer_states: str = "fp32") -> float:
    """Bytes per trainable element of the fp32 master and both Adam moments stored in
    ``optimizer_states`` (12 for fp32, 8 for bf16, about 6.03 for int8)."""
    return STATE_BYTES + 2 * MOMENT_BYTES[check_state_precision(optimizer_states)]


def moment_stored_bytes(numel: int, optimizer_states: str = "fp32") -> int:
    """Bytes of one Adam moment of a ``numel``-element shard as stored: int8 pads the shard to
    whole QUANT_BLOCK blocks, one code byte each plus one fp32 scale per block."""
    if check_state_precision(optimizer_states) != "int8":
        return int(numel * MOMENT_BYTES[optimizer_states])
    blocks = -(-numel // QUANT_BLOCK)
    return blocks * (QUANT_BLOCK + 4)


def optim_stored_bytes(numel: int, optimizer_states: str = "fp32") -> int:
    """Bytes of a ``numel``-element shard's fp32 master and both Adam moments as stored (what
    the engine allocates, per state copy)."""
    return numel * STATE_BYTES + 2 * moment_stored_bytes(numel, optimizer_states)


def check_state_precision(optimizer_states: str) -> str:
    """``optimizer_states`` when tierwise knows it; otherwise a one-line ValueError."""
    if optimizer_states not in MOMENT_BYTES:
        raise ValueError(
            f"optimizer_states {optimizer_states!r}: choose one of {', '.join(STATE_PRECISIONS)}"
        )
    return optimizer_states


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
