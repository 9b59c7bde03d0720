"""The NVMe rows of ``tierwise probe``: tier read/write bandwidth and free space on nvme_path."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import torch
from tierwise.config import Config
from tierwise.probe import cache_nvme, cached_nvme, nvme_key
from tierwise.tiers import PayloadKind

from tierwise_nvme.buffers import aligned_empty
from tierwise_nvme.options import ALIGNMENT
from tierwise_nvme.preflight import check_directory
from tierwise_nvme.swapfile import free_bytes

PROBE_BYTES = 128 << 20
"""Most bytes written then read once per directory (a quick, page-cache-free measurement)."""
PROBE_SHARE = 8
"""The probe uses at most 1/PROBE_SHARE of the free space (a nearly full disk still probes; the
plan's own need is checked against the free space before allocation: [Note: NVMe preflight])."""

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
        slab = tier.allocate(nbytes, torch.uint8, kind=PayloadKind.STAGING, what="probe")
        begin = time.perf_counter()
        tier.write(slab, buffer).wait()
        write_s = time.perf_counter() - begin
        begin = time.perf_counter()
        tier.read(slab, buffer).wait()
        read_s = time.perf_counter() - begin
    finally:
        tier.close()
    return nbytes / read_s, nbytes / write_s


def probe_nvme(directory: str | Path, *, refresh: bool = False) -> dict[str, Any]:
    """Hardware facts for ``directory`` (checked first: [Note: NVMe preflight]). The bandwidths
    are measured once per directory and cached on disk (core's ``tierwise.probe.cached_nvme``;
    ``refresh`` measures again); free space is read each time."""
    key = nvme_key(check_directory(directory))
    with _lock:
        entry = None if refresh else cached_nvme(key)
        if entry is None:
            share = free_bytes(Path(key)) // PROBE_SHARE // ALIGNMENT * ALIGNMENT
            entry = cache_nvme(
                key, *measure_bandwidth(key, max(ALIGNMENT, min(PROBE_BYTES, share)))
            )
    return {
        "nvme_read_bandwidth": entry["nvme_read_bandwidth"],
        "nvme_write_bandwidth": entry["nvme_write_bandwidth"],
        "nvme_free": free_bytes(Path(key)),
    }


__all__ = ["PROBE_BYTES", "measure_bandwidth", "probe_nvme"]
