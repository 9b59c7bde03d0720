"""Plugin-owned Config keys: declared by core, checked by the plugin that owns them
([Note: plugin-owned settings] in tierwise.config)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import tierwise
from tierwise import config as config_module
from tierwise.config import Config, ConfigError
from tierwise.hookspecs import hookimpl
from tierwise.plugins import PluginError, build_plugin_manager


@dataclasses.dataclass(frozen=True, kw_only=True)
class _FactorSettings:
    PLUGIN_NAME = "factor"

    expert_capacity_factor: float | None = None
    """Refuses factors above 2, rounds to a tenth."""

    def __post_init__(self):
        if self.expert_capacity_factor is not None:
            if self.expert_capacity_factor > 2:
                raise ConfigError.for_field("expert_capacity_factor", 3, "at most 2 here")
            object.__setattr__(
                self, "expert_capacity_factor", round(self.expert_capacity_factor, 1)
            )


def _host_with(*classes):
    class Plugin:
        @hookimpl
        def tierwise_register_settings(self):
            return list(classes)

    host = build_plugin_manager(load_entry_points=False)
    host.pm.register(Plugin(), name="settings_plugin")
    return host


def test_the_owning_plugin_checks_and_normalises_its_key(monkeypatch):
    host = _host_with(_FactorSettings)
    assert host.settings_classes() == {"factor": _FactorSettings}
    monkeypatch.setattr(
        config_module, "_plugin_settings_classes", lambda: host.settings_classes().values()
    )
    assert Config(device="cpu", expert_capacity_factor=1.26).expert_capacity_factor == 1.3
    with pytest.raises(ConfigError, match=r"^Config\.expert_capacity_factor=3: at most 2 here$"):
        Config(device="cpu", expert_capacity_factor=3.0)
    with pytest.raises(ConfigError, match="at most 2"):
        Config.from_any({"expert_capacity_factor": 2.5}, device="cpu")


def test_without_the_owner_a_value_is_kept_as_given(monkeypatch):
    monkeypatch.setattr(config_module, "_plugin_settings_classes", tuple)
    config = Config(device="cpu", expert_capacity_factor=-1.0, nvme_path=Path("/x"))
    assert config.expert_capacity_factor == -1.0 and config.nvme_path == "/x"  # a path: a str


def test_a_settings_class_owns_only_declared_keys_once():
    @dataclasses.dataclass(frozen=True)
    class Stray:
        PLUGIN_NAME = "stray"
        chunk_size: int = 1

    @dataclasses.dataclass(frozen=True)
    class Second:
        PLUGIN_NAME = "second"
        expert_capacity_factor: float | None = None

    with pytest.raises(PluginError, match="'chunk_size' that is no plugin-owned Config key"):
        _host_with(Stray).settings_classes()
    with pytest.raises(PluginError, match="'expert_capacity_factor' is claimed by"):
        _host_with(_FactorSettings, Second).settings_classes()


def test_installed_plugins_own_their_keys():
    owners = {
        f.name: f.metadata[config_module.OWNER] for f in dataclasses.fields(Config) if f.metadata
    }
    assert owners == {"nvme_path": "tierwise-nvme", "expert_capacity_factor": "tierwise-moe"}
    from tierwise.plugins import get_plugin_host

    claimed = {
        f.name
        for cls in get_plugin_host().settings_classes().values()
        for f in dataclasses.fields(cls)
    }
    for key, dist in owners.items():
        installed = _installed(dist)
        assert (key in claimed) == installed, key
    if _installed("tierwise-nvme"):
        assert tierwise.Config(device="cpu", nvme_path=Path("/x")).nvme_path == "/x"
    if _installed("tierwise-moe"):
        with pytest.raises(ConfigError, match="expert_capacity_factor"):
            tierwise.Config(device="cpu", expert_capacity_factor=0)


def _installed(dist: str) -> bool:
    """Installed and not blocked with TIERWISE_DISABLE_PLUGINS."""
    import os
    from importlib.util import find_spec

    blocked = {n.strip() for n in os.environ.get("TIERWISE_DISABLE_PLUGINS", "").split(",")}
    name = dist.removeprefix("tierwise-")
    return find_spec(dist.replace("-", "_")) is not None and name not in blocked
