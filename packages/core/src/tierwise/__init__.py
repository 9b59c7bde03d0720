"""tierwise: train models bigger than your device with chunks across device, host and NVMe."""

from tierwise._version import __version__
from tierwise.config import Config, ConfigError
from tierwise.hardware import Hardware
from tierwise.plan import Plan, PlanError
from tierwise.profile import ParamInfo, Profile

__all__ = [
    "Config",
    "ConfigError",
    "Hardware",
    "ParamInfo",
    "Plan",
    "PlanError",
    "Profile",
    "__version__",
]
