"""Hardware: what the machine can do, as the planner needs it (filled by probe hooks)."""

from __future__ import annotations

from dataclasses import dataclass

from tierwise.jsonable import JsonDataclass


@dataclass(kw_only=True)
class Hardware(JsonDataclass):
    """Capacities, bandwidths and velocities. Unknown values are None; the planner falls back
    to conservative estimates and says so."""

    device_type: str = "cpu"
    """"cuda" or "cpu" (on CPU the compute tier is host RAM with a budget)."""
    device_memory: int | None = None
    """Free memory on the compute device, bytes."""
    host_memory: int | None = None
    """Available host RAM, bytes."""
    h2d_bandwidth: float | None = None
    """Host-to-device copy bandwidth at chunk size, bytes/s (pinned on CUDA)."""
    d2h_bandwidth: float | None = None
    """Device-to-host copy bandwidth at chunk size, bytes/s."""
    device_adam_velocity: float | None = None
    """Chunked AdamW update rate on the device, elements/s."""
    host_adam_velocity: float | None = None
    """Chunked AdamW update rate on the host CPU, elements/s."""
    device_flops: float | None = None
    """Dense matmul throughput of the device in the compute precision, FLOP/s."""
    nvme_read_bandwidth: float | None = None
    """NVMe tier read bandwidth, bytes/s (tierwise-nvme)."""
    nvme_write_bandwidth: float | None = None
    """NVMe tier write bandwidth, bytes/s (tierwise-nvme)."""
    nvme_free: int | None = None
    """Free bytes on the file system holding nvme_path."""
    interconnect_bandwidth: float | None = None
    """Collective bandwidth between data-parallel ranks, bytes/s."""
    world_size: int = 1
    """Number of data-parallel ranks."""
