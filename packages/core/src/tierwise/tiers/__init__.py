"""Tiers: where chunk payloads live (device, host; nvme comes from tierwise-nvme)."""

from tierwise.tiers.base import DONE, IOHandle, PayloadKind, Slab, Tier, TierBudgetError
from tierwise.tiers.memory import DeviceTier, HostTier, MemoryTier

__all__ = [
    "DONE",
    "DeviceTier",
    "HostTier",
    "IOHandle",
    "MemoryTier",
    "PayloadKind",
    "Slab",
    "Tier",
    "TierBudgetError",
]
