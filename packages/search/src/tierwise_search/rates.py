"""Bandwidths, velocities and capacities the cost model uses, taken from ``Hardware``.

Every figure comes from the hardware probe. Where the probe left one unknown (None), a
conservative fallback below is used and a line saying so goes into ``Plan.reasons``; these are
the only hard-coded numbers in the search. All rates are per data-parallel rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from tierwise.hardware import Hardware, HardwareError

from tierwise_search.compute import ComputeRates

GB = 1e9

# Conservative fallbacks (deliberately low: a plan made with them over-estimates transfer time).
FALLBACKS: dict[str, dict[str, float]] = {
    "cuda": {
        "h2d_bandwidth": 6 * GB,  # bytes/s: PCIe 3 x16, pageable
        "d2h_bandwidth": 6 * GB,
        "device_adam_velocity": 5e9,  # elements/s
        "host_adam_velocity": 2e8,
        "device_flops": 20e12,  # FLOP/s
        # below the lowest published large-model figure (Llama 3 on H100s: 38 %)
        "matmul_efficiency": 0.35,
        "device_memory_bandwidth": 300 * GB,
        "nvme_read_bandwidth": 1 * GB,
        "nvme_write_bandwidth": 0.5 * GB,
        "interconnect_bandwidth": 5 * GB,
        # one 100 Gb/s adapter per node shared by 8 GPUs, 80 % of its rate
        "network_bandwidth": 1.25 * GB,
    },
    "cpu": {
        "h2d_bandwidth": 2 * GB,  # the "device" is host RAM: a single-threaded memcpy
        "d2h_bandwidth": 2 * GB,
        "device_adam_velocity": 2e8,
        "host_adam_velocity": 2e8,
        "device_flops": 2e10,
        "matmul_efficiency": 1.0,  # a probed CPU rate is a measured (achieved) matmul rate
        "device_memory_bandwidth": 2 * GB,  # as h2d: a single-threaded memcpy
        "nvme_read_bandwidth": 0.5 * GB,
        "nvme_write_bandwidth": 0.25 * GB,
        "interconnect_bandwidth": 1 * GB,
        "network_bandwidth": 1 * GB,
    },
}


@dataclass(frozen=True, kw_only=True)
class Rates:
    """Resolved figures; every one is known (probed or fallback)."""

    h2d: float
    """Host -> device bytes/s."""
    d2h: float
    """Device -> host bytes/s."""
    nvme_read: float
    """NVMe -> host bytes/s available to one rank (the node's disks shared by its ranks)."""
    nvme_write: float
    """Host -> NVMe bytes/s available to one rank."""
    device_adam: float
    """Device optimizer elements/s."""
    host_adam: float
    """Host optimizer elements/s available to one rank (the node's CPU shared by its ranks)."""
    flops: float
    """Device FLOP/s in the compute precision."""
    matmul_efficiency: float
    """The largest fraction of ``flops`` training matmuls reach (``Hardware.matmul_efficiency``)."""
    memory_bandwidth: float
    """Bytes/s memory-bound ops reach on the device."""
    interconnect: float
    """Collective bytes/s per rank: NVLink inside one node, the slower of it and the network
    when the ranks span several nodes (a ring crosses the network)."""
    overlap: bool
    """Transfers overlap compute (CUDA side streams); on CPU they share the cores."""
    device_is_host: bool
    """The compute device is host RAM (CPU): a host->device copy is a memcpy on the compute
    cores, and an NVMe read lands in device memory directly."""
    world_size: int
    """Data-parallel ranks."""
    ranks_per_node: int = 1
    """Ranks sharing one node's host memory, CPU and NVMe."""
    fallbacks: dict[str, str] = field(default_factory=dict)
    """Hardware field -> reason line, for figures that were not probed."""

    @property
    def compute(self) -> ComputeRates:
        return ComputeRates(self.flops, self.matmul_efficiency, self.memory_bandwidth)


# [Note: shared per node]
# A plan is made for one rank, but a node's ranks share what is not per GPU: its host memory
# and NVMe space (``_Search`` gives each rank 1/ranks_per_node of them), its host CPU (each
# rank's host Adam velocity is the node's over ranks_per_node) and its NVMe bandwidth (likewise).
# PCIe is per GPU (h2d/d2h unchanged). Collectives run over NVLink inside one node and over the
# network between nodes: a ring that crosses nodes goes at the slower of the two. So ranks on
# one node never add CPU, memory or disk the node does not have, and a refusal that binds on
# host memory or NVMe never names more GPUs on the same node as a remedy.
def resolve_rates(hardware: Hardware) -> Rates:
    kind = "cuda" if hardware.device_type == "cuda" else "cpu"
    table = FALLBACKS[kind]
    fallbacks: dict[str, str] = {}

    def pick(name: str) -> float:
        value = getattr(hardware, name)
        if value is None or value <= 0:
            value = table[name]
            fallbacks[name] = (
                f"hardware.{name} unknown: assumed {value:.3g} (conservative {kind} fallback)"
            )
        return float(value)

    if kind == "cpu" and not hardware.device_memory_bandwidth and hardware.h2d_bandwidth:
        # the "device" is host RAM: its probed copy rate is the bandwidth memory-bound ops get
        hardware = replace(hardware, device_memory_bandwidth=hardware.h2d_bandwidth)
    efficiency = pick("matmul_efficiency")
    if efficiency > 1:
        raise HardwareError(
            f"matmul_efficiency {efficiency:g} is above 1: give the fraction of device_flops "
            "that training matmuls reach (e.g. 0.52)"
        )
    # a node's host CPU and NVMe are shared by its ranks; PCIe is per GPU: [Note: shared per node]
    per_node = hardware.ranks_per_node
    interconnect = pick("interconnect_bandwidth")
    if hardware.nodes > 1:
        interconnect = min(interconnect, pick("network_bandwidth"))
    return Rates(
        h2d=pick("h2d_bandwidth"),
        d2h=pick("d2h_bandwidth"),
        nvme_read=pick("nvme_read_bandwidth") / per_node,
        nvme_write=pick("nvme_write_bandwidth") / per_node,
        device_adam=pick("device_adam_velocity"),
        host_adam=pick("host_adam_velocity") / per_node,
        flops=pick("device_flops"),
        matmul_efficiency=efficiency,
        memory_bandwidth=pick("device_memory_bandwidth"),
        interconnect=interconnect,
        overlap=kind == "cuda",
        device_is_host=kind == "cpu",
        world_size=max(1, int(hardware.world_size or 1)),
        ranks_per_node=per_node,
        fallbacks=fallbacks,
    )


__all__ = ["FALLBACKS", "Rates", "resolve_rates"]
