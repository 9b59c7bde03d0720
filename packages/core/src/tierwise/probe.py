"""Core's hardware facts: capacities only (bandwidths come from tierwise-profiler)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tierwise.config import Config


def available_host_memory() -> int | None:
    """MemAvailable from /proc/meminfo, bytes (None where unknown)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def basic_probe(config: Config) -> dict[str, Any]:
    device = torch.device(config.device)
    facts: dict[str, Any] = {"device_type": device.type, "host_memory": available_host_memory()}
    if device.type == "cuda" and torch.cuda.is_available():
        free, _total = torch.cuda.mem_get_info(device)
        facts["device_memory"] = int(free)
    elif device.type == "cpu":
        facts["device_memory"] = facts["host_memory"]
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        facts["world_size"] = torch.distributed.get_world_size()
    return facts
