"""tierwise: train models bigger than your device with chunks across device, host and NVMe."""

from __future__ import annotations

import importlib
import importlib.util

from tierwise._version import __version__

# [Note: lazy package attributes] Every ``tierwise.x`` import runs this file first: the CLI, each
# plugin's hookspecs import, ``tierwise profile`` and ``tierwise plan``. Importing the runtime here
# (engine, chunks, tiers, optimizer, checkpoints) would make all of them pay for it, so the public
# names are loaded on first use (PEP 562); ``tierwise.setup`` and friends are unchanged for users.
_PUBLIC = {
    "clip_grad_norm_": "tierwise.api",
    "engine_of": "tierwise.api",
    "from_pretrained": "tierwise.pretrained",
    "save_pretrained": "tierwise.integrations.hf_save",
    "no_sync": "tierwise.api",
    "setup": "tierwise.api",
    "load_checkpoint": "tierwise.checkpoint.directory",
    "save_checkpoint": "tierwise.checkpoint.directory",
    "Config": "tierwise.config",
    "ConfigError": "tierwise.config",
    "Hardware": "tierwise.hardware",
    "Plan": "tierwise.plan",
    "PlanError": "tierwise.plan",
    "ParamInfo": "tierwise.profile",
    "Profile": "tierwise.profile",
}


def _plugin_settings_classes() -> list[type]:
    from tierwise.plugins import get_plugin_host

    return list(get_plugin_host().settings_classes().values())


# [Note: plugin-owned settings] in tierwise.config: Config sits below the plugin host, so the
# package, which sits above both, tells it where the plugins' settings classes come from. The
# host is built on the first call (a plugin-owned key set), not here.
_config_module = importlib.import_module("tierwise.config")
_config_module.read_plugin_settings_from(_plugin_settings_classes)


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
    elif importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(
            f"{__name__}.{name}"
        )  # ``tierwise.api`` after ``import tierwise``
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})


__all__ = [
    "clip_grad_norm_",
    "engine_of",
    "from_pretrained",
    "load_checkpoint",
    "no_sync",
    "save_checkpoint",
    "save_pretrained",
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
