"""Which action each transformer block's saved activations get: keep, recompute, or swap to host
or nvme.

A *block* is a transformer layer (``find_blocks``). ``resolve_policy`` gives each block one action
from ``Config.activation_policy``, ``activation_offload``, ``activation_checkpointing`` or the plan;
setup calls it before anything changes, and ``ActivationManager`` (in ``manager``) executes it.
"""

from __future__ import annotations

import fnmatch
from collections import Counter

import torch

from tierwise.plan import ACTIVATION_ACTIONS, check_policy_entries

ACTIONS = ACTIVATION_ACTIONS


class ActivationPolicyError(ValueError):
    """An activation policy names blocks that do not exist or an action that cannot run."""


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


def plan_action(block: str, plan_policy: dict[str, str]) -> str | None:
    """The plan's action for ``block``: its own entry, else the most common one among entries
    of modules inside it (a profile can be per innermost module)."""
    if block in plan_policy:
        return plan_policy[block]
    inner = [a for name, a in plan_policy.items() if name.startswith(block + ".")]
    return Counter(inner).most_common(1)[0][0] if inner else None


def resolve_policy(
    blocks: list[str],
    *,
    policy: dict[str, str] | None,
    offload: str,
    checkpointing: bool,
    plan_policy: dict[str, str] | None = None,
) -> dict[str, str]:
    """Action per block, in this order of precedence: ``policy`` (name or fnmatch pattern ->
    action; a later entry wins over an earlier one for the same block), then ``offload``
    "host"/"nvme" (every block), then ``checkpointing`` (every block recomputed), then for
    ``offload="auto"`` the plan's per-layer policy; anything left is kept."""
    if offload in ("host", "nvme"):
        default = {b: offload for b in blocks}
    elif checkpointing:
        default = {b: "recompute" for b in blocks}
    elif offload == "auto":
        default = {b: plan_action(b, plan_policy or {}) or "keep" for b in blocks}
    else:
        default = {b: "keep" for b in blocks}
    for pattern, action in (policy or {}).items():
        matched = [b for b in blocks if b == pattern or fnmatch.fnmatchcase(b, pattern)]
        if not matched:
            shown = ", ".join(blocks) if blocks else "none found"
            raise ActivationPolicyError(
                f"Config.activation_policy: {pattern!r} matches no transformer block; the blocks "
                f"are: {shown}"
            )
        for block in matched:
            default[block] = action
    return default


__all__ = [
    "ACTIONS",
    "ActivationPolicyError",
    "check_policy_entries",
    "find_blocks",
    "plan_action",
    "resolve_policy",
]
