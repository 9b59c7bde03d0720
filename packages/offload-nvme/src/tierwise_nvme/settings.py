"""NVMeSettings: the Config keys tierwise-nvme owns, with their checks.

Registered through ``tierwise_register_settings``; Config hands it the keys the user set
([Note: plugin-owned settings] in ``tierwise.config``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class NVMeSettings:
    """Where the NVMe tier keeps its files. The base settings (no path) mean no NVMe tier."""

    PLUGIN_NAME = "nvme"

    nvme_path: str | None = None
    """Directory on a fast disk for the NVMe tier (a str or os.PathLike; kept as a str)."""

    def __post_init__(self) -> None:
        if self.nvme_path is not None:
            object.__setattr__(self, "nvme_path", os.fspath(self.nvme_path))
