"""Hardware: what the machine can do, as the planner needs it (filled by probe hooks)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

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
    matmul_efficiency: float | None = None
    """The largest fraction of ``device_flops`` a training step's matrix products reach (a
    published measurement, cited in the preset); the search never predicts more. None: probed
    rates are achieved ones (1.0 on a CPU), a conservative fallback on CUDA."""
    device_memory_bandwidth: float | None = None
    """Memory bandwidth memory-bound ops (element-wise, norms, softmax) achieve on the device,
    bytes/s."""
    nvme_read_bandwidth: float | None = None
    """NVMe tier read bandwidth, bytes/s (tierwise-nvme)."""
    nvme_write_bandwidth: float | None = None
    """NVMe tier write bandwidth, bytes/s (tierwise-nvme)."""
    nvme_free: int | None = None
    """Free bytes on the file system holding nvme_path."""
    interconnect_bandwidth: float | None = None
    """Collective bandwidth between data-parallel ranks inside one node (NVLink on SXM
    boards), bytes/s per rank."""
    network_bandwidth: float | None = None
    """Collective bandwidth between nodes, bytes/s per rank (the node's network adapters
    over its GPUs); used when the ranks span several nodes."""
    world_size: int = 1
    """Number of data-parallel ranks."""
    gpus_per_node: int | None = None
    """Ranks on one node (None: min(world_size, 8)). A node's ranks share its host memory,
    host CPU (Adam) and NVMe bandwidth and capacity; each GPU has its own PCIe link."""

    @property
    def ranks_per_node(self) -> int:
        """Ranks sharing one node's host memory, CPU and NVMe."""
        per_node = self.gpus_per_node or min(self.world_size, 8)
        return max(1, min(per_node, self.world_size))

    @property
    def nodes(self) -> int:
        return -(-self.world_size // self.ranks_per_node)


class HardwareError(ValueError):
    """A hardware preset or file that cannot be used; the message says what to pass instead."""


PRESET_DIR = Path(__file__).parent / "hardware_presets"
"""One ``<name>.toml`` per preset: Hardware fields, each number with its source in a comment."""


def preset_names() -> list[str]:
    """The shipped presets: GPUs (device fields) and NVMe classes (NVMe fields)."""
    return sorted(path.stem for path in PRESET_DIR.glob("*.toml"))


def hardware_facts(spec: str) -> dict[str, Any]:
    """Hardware fields from ``spec``: preset names and/or JSON/TOML files, comma-separated,
    later ones overriding earlier ones (``"a100-80gb,pcie4-nvme"``). Raises HardwareError."""
    facts: dict[str, Any] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        facts.update(_read_one(part))
    if not facts:
        raise HardwareError(
            f"--hardware {spec!r}: give a preset ({', '.join(preset_names())}) or a JSON file"
        )
    return facts


def _read_one(part: str) -> dict[str, Any]:
    path = PRESET_DIR / f"{part}.toml"
    if not path.is_file():
        path = Path(part)
        if path.suffix.lower() not in (".json", ".toml") or not path.is_file():
            raise HardwareError(
                f"--hardware {part!r}: no such preset or file; presets: {', '.join(preset_names())}"
                " (or a JSON file of tierwise.hardware.Hardware fields)"
            )
    try:
        if path.suffix.lower() == ".toml":
            import tomllib

            data = tomllib.loads(path.read_text())
        else:
            data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise HardwareError(f"--hardware {part}: cannot read it ({err})") from None
    if not isinstance(data, dict):
        raise HardwareError(f"--hardware {part}: expected an object of Hardware fields")
    known = {f.name for f in fields(Hardware)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise HardwareError(
            f"--hardware {part}: unknown field(s) {', '.join(unknown)}; Hardware fields are "
            f"{', '.join(sorted(known))}"
        )
    for name, value in data.items():
        expected = str if name == "device_type" else (int, float)
        if value is not None and (isinstance(value, bool) or not isinstance(value, expected)):
            raise HardwareError(
                f"--hardware {part}: {name}={value!r} is not a {'string' if expected is str else 'number'}"
            )
    return data
