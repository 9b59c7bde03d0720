"""tierwise: train models bigger than your device with chunks across device, host and NVMe."""

from tierwise._version import __version__
from tierwise.api import clip_grad_norm_, engine_of, no_sync, setup
from tierwise.checkpoint import load_checkpoint, save_checkpoint
from tierwise.config import Config, ConfigError
from tierwise.hardware import Hardware
from tierwise.plan import Plan, PlanError
from tierwise.profile import ParamInfo, Profile

__all__ = [
    "clip_grad_norm_",
    "engine_of",
    "load_checkpoint",
    "no_sync",
    "save_checkpoint",
    "setup",
    "Config",
    "ConfigError",
    "Hardware",
    "ParamInfo",
    "Plan",
    "PlanError",
    "Profile",
    "__version__",
]
