"""Core's hardware facts: capacities only (bandwidths come from tierwise-profiler), whether a
compute device is present, and the on-disk cache of measurements shared by the probe plugins."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
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


def ranks_on_this_node() -> int:
    """This process's ranks sharing its node, as ``basic_probe`` counts them for
    ``Hardware.ranks_per_node``: LOCAL_WORLD_SIZE (torchrun sets it), else min(world, 8); 1
    outside torch.distributed."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return 1
    world = torch.distributed.get_world_size()
    return max(1, min(int(os.environ.get("LOCAL_WORLD_SIZE", min(world, 8))), world))


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


def device_present(device: str | torch.device) -> bool:
    """Whether ``device`` exists on this machine. The only CUDA query made before a CUDA device
    is known to be there: ``torch.cuda.is_available()`` first (it creates no context)."""
    device = torch.device(device)
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()
    return False


def basic_probe(config: Config) -> dict[str, Any]:
    device = torch.device(config.device)
    facts: dict[str, Any] = {"device_type": device.type, "host_memory": available_host_memory()}
    if device.type == "cuda" and device_present(device):
        facts["device_memory"] = free_device_memory(device)
    elif device.type == "cpu":
        facts["device_memory"] = facts["host_memory"]
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        facts["world_size"] = torch.distributed.get_world_size()
        # torchrun's ranks on this node share its host memory, CPU and NVMe
        facts["gpus_per_node"] = ranks_on_this_node()
    return facts


# -- the measurement cache ------------------------------------------------------------------
NVME_CACHE_FILE = "nvme.json"
"""Per-directory NVMe bandwidths measured by tierwise-nvme (``tierwise probe --nvme-path``)."""


def cache_dir() -> Path:
    """``$TIERWISE_CACHE_DIR``, else ``$XDG_CACHE_HOME/tierwise``, else ``~/.cache/tierwise``."""
    explicit = os.environ.get("TIERWISE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tierwise"


def read_cache(name: str) -> dict[str, Any]:
    """The entries of cache file ``name`` ({} when missing or unreadable)."""
    try:
        data = json.loads((cache_dir() / name).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_cache(name: str, key: str, entry: dict[str, Any] | None) -> None:
    """Add, replace or (``entry`` None) remove one entry of cache file ``name`` (written to a
    temporary file, then swapped in, so a reader never sees half a file)."""
    path = cache_dir() / name
    entries = read_cache(name)
    if entry is None:
        entries.pop(key, None)
    else:
        entries[key] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(f".{os.getpid()}.tmp")
    temporary.write_text(json.dumps(entries, indent=1, sort_keys=True))
    os.replace(temporary, path)


def nvme_key(directory: str | os.PathLike) -> str:
    """The cache key of an NVMe directory: its resolved path."""
    return str(Path(directory).expanduser().resolve())


def cached_nvme(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The cached measurement of ``directory``: ``{"nvme_read_bandwidth", "nvme_write_bandwidth",
    "measured_at"}``, or None when it was never measured."""
    return read_cache(NVME_CACHE_FILE).get(nvme_key(directory))


def forget_nvme(directory: str | os.PathLike) -> None:
    """Drop the cached measurement of ``directory`` (the next probe measures it again)."""
    write_cache(NVME_CACHE_FILE, nvme_key(directory), None)


def cache_nvme(directory: str | os.PathLike, read: float, write: float) -> dict[str, Any]:
    entry = {
        "nvme_read_bandwidth": read,
        "nvme_write_bandwidth": write,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    write_cache(NVME_CACHE_FILE, nvme_key(directory), entry)
    return entry
