"""The machine a plan or profile is made for (``--hardware``, ``--gpus``, ``--nvme``): presets or
files for a machine that is not this one, else a probe of a device that is present here.

Shared by ``tierwise plan`` (tierwise-search) and ``tierwise profile`` (tierwise-profiler). The
probe runs only for a device this machine has; on a laptop, a login node or CI (no CUDA) asking
for a CUDA plan without ``--hardware`` is one line naming the presets, never a CUDA call.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from tierwise.hardware import Hardware, HardwareError, hardware_facts, preset_names
from tierwise.probe import cached_nvme, device_present


@dataclass
class Target:
    """The hardware to plan for and, one line each, where its figures came from."""

    hardware: Hardware
    notes: list[str] = field(default_factory=list)


def target_hardware(
    *,
    spec: str | None,
    device: str | None,
    gpus: int,
    gpus_per_node: int | None = None,
    device_memory: int | None = None,
    nvme_path: str | None = None,
    precision: str = "bf16",
) -> Target:
    """Hardware from ``spec`` (``--hardware NAME|FILE,...``) or, without one, the probe of
    ``device`` (default cuda) when it is present; raise HardwareError otherwise.

    ``device_memory`` (bytes) replaces the device capacity; ``gpus`` is the number of
    data-parallel ranks, ``gpus_per_node`` how many share one node (default min(gpus, 8)). With ``nvme_path``, a measurement cached by ``tierwise probe
    --nvme-path`` for that directory wins over preset or assumed NVMe bandwidths.
    """
    if gpus < 1:
        raise HardwareError(f"--gpus {gpus}: give at least 1")
    per_node = min(gpus, 8) if gpus_per_node is None else gpus_per_node
    if per_node < 1 or gpus % per_node:
        raise HardwareError(
            f"--gpus-per-node {per_node}: give a count of at least 1 that divides --gpus {gpus} "
            "(the nodes hold equally many ranks)"
        )
    notes = []
    if spec:
        facts = hardware_facts(spec)
        facts.setdefault("device_type", device.split(":")[0] if device else "cuda")
        notes.append(
            f"hardware: --hardware {spec} (figures and their sources: tierwise "
            "plan --help lists the presets; README 'Hardware fields')"
        )
    else:
        wanted = device or "cuda"
        if not device_present(wanted):
            raise HardwareError(
                f"no {wanted} device on this machine to probe: pass --hardware NAME or FILE.json "
                f"to plan for another machine (presets: {', '.join(preset_names())}), or "
                "--device cpu to plan for this one"
            )
        from tierwise.config import Config
        from tierwise.plugins import get_plugin_host

        config = Config(device=wanted, precision=precision, nvme_path=nvme_path)
        facts = get_plugin_host().probe_hardware(config=config)
        facts["device_type"] = wanted.split(":")[0]
        notes.append(f"hardware: probed this machine's {wanted}")
    facts["world_size"] = gpus
    facts["gpus_per_node"] = per_node
    if device_memory is not None:
        facts["device_memory"] = device_memory
    if nvme_path:
        notes.append(_nvme_figures(facts, nvme_path, probed=not spec))
    return Target(Hardware(**facts), notes)


def _nvme_figures(facts: dict, nvme_path: str, *, probed: bool) -> str:
    """Put the NVMe figures for ``nvme_path`` into ``facts``; say which were used."""
    cached = cached_nvme(nvme_path)
    if cached is not None:
        facts["nvme_read_bandwidth"] = cached["nvme_read_bandwidth"]
        facts["nvme_write_bandwidth"] = cached["nvme_write_bandwidth"]
        where = (
            f"measured for {nvme_path} at {cached['measured_at']} (cached; tierwise probe "
            "--nvme-path DIR --refresh measures again)"
        )
    elif facts.get("nvme_read_bandwidth"):
        where = "from --hardware"
    else:
        return (
            f"NVMe bandwidth: not measured for {nvme_path} and not in --hardware: assumed "
            "(see the fallback line); measure it with tierwise probe --nvme-path "
            f"{nvme_path}, or add a preset such as pcie4-nvme"
        )
    if probed and facts.get("nvme_free") is None and Path(nvme_path).is_dir():
        facts["nvme_free"] = shutil.disk_usage(nvme_path).free
    return (
        f"NVMe bandwidth: read {facts['nvme_read_bandwidth'] / 1e9:.3g} GB/s, write "
        f"{facts['nvme_write_bandwidth'] / 1e9:.3g} GB/s, {where}"
    )


__all__ = ["Target", "target_hardware"]
