"""tierwise-nvme: an NVMe tier on Linux AIO and the out-of-core optimizer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tierwise.hookspecs import hookimpl

from tierwise_nvme._version import __version__
from tierwise_nvme.errors import NVMeIOError, NVMeSpaceError
from tierwise_nvme.options import NVMeOptions
from tierwise_nvme.settings import NVMeSettings
from tierwise_nvme.staging import StagingPool
from tierwise_nvme.tier import NVMeTier

if TYPE_CHECKING:
    from tierwise.config import Config


@hookimpl
def tierwise_register_tiers() -> list[type]:
    return [NVMeTier]


@hookimpl
def tierwise_register_settings() -> list[type]:
    return [NVMeSettings]


@hookimpl
def tierwise_probe_hardware(config: Config) -> dict[str, Any] | None:
    if not config.nvme_path:
        return None
    from tierwise_nvme.probe import probe_nvme

    return probe_nvme(config.nvme_path)


__all__ = [
    "NVMeIOError",
    "NVMeOptions",
    "NVMeSettings",
    "NVMeSpaceError",
    "NVMeTier",
    "StagingPool",
    "__version__",
    "tierwise_probe_hardware",
    "tierwise_register_settings",
    "tierwise_register_tiers",
]
