"""Which action each transformer block's saved activations get: keep, recompute, or swap to host
or nvme.

A *block* is a transformer layer (``find_blocks``). ``resolve_policy`` (in ``tierwise.plan``,
where the planner resolves the same way) gives each block one action
from ``Config.activation_policy``, ``activation_offload``, ``activation_checkpointing`` or the plan;
setup calls it before anything changes, and ``ActivationManager`` (in ``manager``) executes it.
"""

from __future__ import annotations

import torch

from tierwise.plan import (
    ACTIVATION_ACTIONS,
    ActivationPolicyError,
    check_policy_entries,
    plan_action,
    resolve_policy,
)

ACTIONS = ACTIVATION_ACTIONS


def find_blocks(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The transformer blocks of ``model`` in forward order: modules of a class the model lists
    in ``_no_split_modules`` (Hugging Face), else the entries of every ``nn.ModuleList`` with at
    least two modules; the outermost ones only."""
    found: dict[str, torch.nn.Module] = {}

    def inside(name: str) -> bool:
        return any(name.startswith(block + ".") for block in found)

    classes = set(getattr(model, "_no_split_modules", None) or ())
    for name, module in model.named_modules():
        if name and type(module).__name__ in classes and not inside(name):
            found[name] = module
    if not found:
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.ModuleList) and len(module) >= 2 and not inside(name):
                for index, child in enumerate(module):
                    found[f"{name}.{index}" if name else str(index)] = child
    return found


__all__ = [
    "ACTIONS",
    "ActivationPolicyError",
    "check_policy_entries",
    "find_blocks",
    "plan_action",
    "resolve_policy",
]
