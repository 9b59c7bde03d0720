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


def free_device_memory(device: torch.device) -> int:
    """Bytes this process may still allocate on a CUDA device: what the device has free plus
    what PyTorch's caching allocator holds unused, capped by
    ``torch.cuda.set_per_process_memory_fraction`` (the allocator refuses to go past fraction x
    total, whatever the device has free)."""
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    usable = free + torch.cuda.memory_reserved(device) - allocated
    fraction_of = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.8
    if fraction_of is not None:
        usable = min(usable, int(fraction_of(device) * total) - allocated)
    return max(0, int(usable))


def basic_probe(config: Config) -> dict[str, Any]:
    device = torch.device(config.device)
    facts: dict[str, Any] = {"device_type": device.type, "host_memory": available_host_memory()}
    if device.type == "cuda" and torch.cuda.is_available():
        facts["device_memory"] = free_device_memory(device)
    elif device.type == "cpu":
        facts["device_memory"] = facts["host_memory"]
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        facts["world_size"] = torch.distributed.get_world_size()
    return facts
