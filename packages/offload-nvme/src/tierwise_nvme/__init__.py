"""tierwise-nvme: an NVMe tier on Linux AIO and the out-of-core optimizer."""

from __future__ import annotations

from tierwise.hookspecs import hookimpl
from tierwise.plugins import not_implemented
from tierwise.tiers import Tier

from tierwise_nvme._version import __version__


class NVMeTier(Tier):
    """Placeholder: chunk payloads in one preallocated file per rank on an NVMe disk."""

    PLUGIN_NAME = "nvme"
    ADDRESSABLE = False

    def __init__(self, **kwargs):
        raise not_implemented("the NVMe tier", "tierwise-nvme")

    allocate = release = read = write = __init__


@hookimpl
def tierwise_register_tiers() -> list[type]:
    return [NVMeTier]


__all__ = ["NVMeTier", "__version__", "tierwise_register_tiers"]
