"""The NVMe rows of ``tierwise probe``: tier read/write bandwidth and free space on nvme_path."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import torch
from tierwise.config import Config

from tierwise_nvme.buffers import aligned_empty
from tierwise_nvme.swapfile import free_bytes

PROBE_BYTES = 128 << 20
"""Bytes written then read once per directory (a quick, page-cache-free measurement)."""

_cache: dict[str, dict[str, Any]] = {}
_lock = threading.Lock()


def measure_bandwidth(directory: str | Path, nbytes: int = PROBE_BYTES) -> tuple[float, float]:
    """(read, write) bytes/s of one ``nbytes`` transfer through an NVMeTier in ``directory``."""
    from tierwise_nvme.tier import NVMeTier

    tier = NVMeTier(
        device=torch.device("cpu"),
        budget=None,
        config=Config(nvme_path=str(directory), device="cpu"),
    )
    try:
        buffer = aligned_empty(nbytes)
        buffer.fill_(1)
        slab = tier.allocate(nbytes, torch.uint8, what="probe")
        begin = time.perf_counter()
        tier.write(slab, buffer).wait()
        write_s = time.perf_counter() - begin
        begin = time.perf_counter()
        tier.read(slab, buffer).wait()
        read_s = time.perf_counter() - begin
    finally:
        tier.close()
    return nbytes / read_s, nbytes / write_s


def probe_nvme(directory: str | Path) -> dict[str, Any]:
    """Hardware facts for ``directory``; the bandwidths are measured once per process."""
    key = str(Path(directory).expanduser().resolve())
    Path(key).mkdir(parents=True, exist_ok=True)
    with _lock:
        if key not in _cache:
            read, write = measure_bandwidth(key)
            _cache[key] = {"nvme_read_bandwidth": read, "nvme_write_bandwidth": write}
    return {**_cache[key], "nvme_free": free_bytes(Path(key))}


__all__ = ["PROBE_BYTES", "measure_bandwidth", "probe_nvme"]
