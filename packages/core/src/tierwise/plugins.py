"""The plugin host: a pluggy PluginManager built by a factory, plus typed hook wrappers.

Plugins are discovered through the ``tierwise`` entry-point group. Core's own tiers, patterns
and planner are registered through the very same hooks (module ``tierwise.builtin``).

Environment switches:
- ``TIERWISE_DISABLE_PLUGINS=a,b`` blocks plugins by entry-point name.
- ``TIERWISE_TRACE_PLUGINS=1`` prints every hook call and its result to stderr.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from functools import lru_cache
from importlib import metadata
from typing import TYPE_CHECKING, Any

import pluggy

from tierwise import hookspecs
from tierwise.config import PluginSettings

if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable

    import torch

    from tierwise.config import Config
    from tierwise.hardware import Hardware
    from tierwise.plan import Plan
    from tierwise.profile import Profile
    from tierwise.protocols import MemoryTracer

BUILTIN_NAME = "core"


class PluginError(RuntimeError):
    """A plugin registered something inconsistent (missing or duplicate names)."""


@dataclass(frozen=True, kw_only=True)
class PluginInfo:
    """What ``tierwise plugins`` reports for one plugin."""

    name: str
    """Entry-point name (or "core" for the built-ins)."""
    distribution: str
    """The installed distribution providing it."""
    version: str
    """That distribution's version."""
    tiers: tuple[str, ...]
    """PLUGIN_NAMEs of tier classes it registers."""
    patterns: tuple[str, ...]
    """PLUGIN_NAMEs of parallel patterns it registers."""
    hooks: tuple[str, ...]
    """Names of the hooks it implements."""


def _disabled_names() -> set[str]:
    raw = os.environ.get("TIERWISE_DISABLE_PLUGINS", "")
    return {name.strip() for name in raw.split(",") if name.strip()}


def _collect_classes(pm: pluggy.PluginManager, hook_name: str) -> dict[str, type]:
    """Call a class-registration hook and index the classes by PLUGIN_NAME.

    A missing PLUGIN_NAME or one registered twice is an error naming the plugins involved.
    """
    found: dict[str, tuple[type, str]] = {}
    hook_caller = getattr(pm.hook, hook_name)
    for impl in hook_caller.get_hookimpls():
        plugin_name = pm.get_name(impl.plugin) or repr(impl.plugin)
        for cls in impl.function() or []:
            name = getattr(cls, "PLUGIN_NAME", None)
            if not isinstance(name, str) or not name:
                raise PluginError(
                    f"plugin {plugin_name!r} registered {cls!r} through {hook_name} without a "
                    "PLUGIN_NAME class attribute: add PLUGIN_NAME = '<unique name>'"
                )
            if name in found:
                _, other = found[name]
                raise PluginError(
                    f"PLUGIN_NAME {name!r} is registered twice through {hook_name}: by plugin "
                    f"{other!r} ({found[name][0].__qualname__}) and by plugin {plugin_name!r} "
                    f"({cls.__qualname__}); rename one or disable a plugin with "
                    "TIERWISE_DISABLE_PLUGINS"
                )
            found[name] = (cls, plugin_name)
    return {name: cls for name, (cls, _) in found.items()}


class PluginHost:
    """Typed access to the hooks. Build it with :func:`get_plugin_host`, never at import time."""

    def __init__(self, pm: pluggy.PluginManager, dists: dict[str, tuple[str, str]]):
        self.pm = pm
        self._dists = dists  # plugin name -> (distribution, version)

    # -- class registries -------------------------------------------------------------------
    def tier_classes(self) -> dict[str, type]:
        """All tier classes by PLUGIN_NAME."""
        return _collect_classes(self.pm, "tierwise_register_tiers")

    def pattern_classes(self) -> dict[str, type]:
        """All parallel pattern classes by PLUGIN_NAME."""
        return _collect_classes(self.pm, "tierwise_register_parallel_patterns")

    def settings_classes(self) -> dict[str, type]:
        """All plugin settings classes by PLUGIN_NAME; each field is a plugin-owned Config key
        ([Note: plugin-owned settings]) that no other class claims."""
        classes = _collect_classes(self.pm, "tierwise_register_settings")
        _check_settings_keys(classes)
        return classes

    # -- typed wrappers ---------------------------------------------------------------------
    def profile_model(
        self, *, model: torch.nn.Module, example_batch: Any, config: Config
    ) -> Profile | None:
        return self.pm.hook.tierwise_profile_model(
            model=model, example_batch=example_batch, config=config
        )

    def make_plan(self, *, profile: Profile, hardware: Hardware, config: Config) -> Plan:
        plan = self.pm.hook.tierwise_make_plan(
            profile=profile, hardware=hardware, config=config, tier_classes=self.tier_classes()
        )
        if plan is None:  # core's planner always answers; None means it was disabled
            raise PluginError("no planner answered tierwise_make_plan")
        from tierwise.plan import fill_io_buffer_bytes

        fill_io_buffer_bytes(plan, profile)
        return plan

    def probe_hardware(self, *, config: Config) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        # pluggy returns results last-registered first; apply core first so plugins refine it
        for result in reversed(self.pm.hook.tierwise_probe_hardware(config=config)):
            if result:
                merged.update(result)
        return merged

    def memory_tracer(
        self, *, device: torch.device, model_bytes: Callable[[], int]
    ) -> MemoryTracer | None:
        """A warm-up memory tracer from a plugin (tierwise-profiler), or None."""
        return self.pm.hook.tierwise_memory_tracer(device=device, model_bytes=model_bytes)

    def add_cli_commands(self, *, subparsers: argparse._SubParsersAction) -> None:
        self.pm.hook.tierwise_add_cli_commands(subparsers=subparsers)

    # -- introspection ----------------------------------------------------------------------
    def infos(self) -> list[PluginInfo]:
        """One entry per registered plugin, core first."""
        infos = []
        for name, plugin in self.pm.list_name_plugin():
            if plugin is None:  # blocked by TIERWISE_DISABLE_PLUGINS
                continue
            dist, version = self._dists.get(name, ("?", "?"))
            hooks = tuple(sorted(caller.name for caller in self.pm.get_hookcallers(plugin) or []))
            infos.append(
                PluginInfo(
                    name=name,
                    distribution=dist,
                    version=version,
                    tiers=_names_from(plugin, "tierwise_register_tiers"),
                    patterns=_names_from(plugin, "tierwise_register_parallel_patterns"),
                    hooks=hooks,
                )
            )
        infos.sort(key=lambda info: (info.name != BUILTIN_NAME, info.name))
        return infos


def _check_settings_keys(classes: dict[str, type]) -> None:
    """Each field of a settings class must be a plugin-owned Config key, claimed once."""
    declared = {f.name for f in dataclasses.fields(PluginSettings)}
    claimed: dict[str, str] = {}
    for name, cls in classes.items():
        for key in (f.name for f in dataclasses.fields(cls)):
            if key not in declared:
                raise PluginError(
                    f"settings {name!r} ({cls.__qualname__}) has a field {key!r} that is no "
                    f"plugin-owned Config key; those are: {', '.join(sorted(declared))}"
                )
            if key in claimed:
                raise PluginError(
                    f"the Config key {key!r} is claimed by the settings {claimed[key]!r} and "
                    f"{name!r}; disable a plugin with TIERWISE_DISABLE_PLUGINS"
                )
            claimed[key] = name


def _names_from(plugin: Any, hook_name: str) -> tuple[str, ...]:
    fn = getattr(plugin, hook_name, None)
    if fn is None:
        return ()
    return tuple(getattr(cls, "PLUGIN_NAME", "?") for cls in fn() or [])


def _trace(pm: pluggy.PluginManager) -> None:
    def before(hook_name, hook_impls, kwargs):
        names = [impl.plugin_name for impl in hook_impls]
        print(
            f"[tierwise plugins] call {hook_name}({', '.join(kwargs)}) -> {names}", file=sys.stderr
        )

    def after(outcome, hook_name, hook_impls, kwargs):
        print(f"[tierwise plugins] done {hook_name}: {outcome.get_result()!r}", file=sys.stderr)

    pm.add_hookcall_monitoring(before, after)


def build_plugin_manager(*, load_entry_points: bool = True) -> PluginHost:
    """Build a fresh PluginHost: core built-ins plus every enabled entry point."""
    from tierwise import __version__, builtin

    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    pm.register(builtin, name=BUILTIN_NAME)
    dists = {BUILTIN_NAME: ("tierwise", __version__)}
    disabled = _disabled_names()
    for name in disabled:
        pm.set_blocked(name)
    if load_entry_points:
        for ep in metadata.entry_points(group=hookspecs.PROJECT_NAME):
            if ep.name in disabled or pm.has_plugin(ep.name):
                continue
            module = ep.load()
            pm.register(module, name=ep.name)
            if ep.dist is not None:
                dists[ep.name] = (ep.dist.name, ep.dist.version)
    _check_hook_names(pm)
    if os.environ.get("TIERWISE_TRACE_PLUGINS") == "1":
        _trace(pm)
    return PluginHost(pm, dists)


def _check_hook_names(pm: pluggy.PluginManager) -> None:
    """A hookimpl whose name matches no hookspec (a misspelling) would never be called: refuse it."""
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as err:
        plugin = pm.get_name(err.plugin) if err.plugin is not None else "?"
        known = ", ".join(sorted(n for n in dir(hookspecs) if n.startswith("tierwise_")))
        raise PluginError(
            f"plugin {plugin!r} implements a hook tierwise does not define ({err}); "
            f"hooks are: {known}"
        ) from None


@lru_cache(maxsize=1)
def _cached_host(disabled: str, trace: str) -> PluginHost:
    return build_plugin_manager()


def get_plugin_host() -> PluginHost:
    """The process-wide PluginHost (rebuilt when the environment switches change)."""
    return _cached_host(
        os.environ.get("TIERWISE_DISABLE_PLUGINS", ""),
        os.environ.get("TIERWISE_TRACE_PLUGINS", ""),
    )


__all__ = ["PluginError", "PluginHost", "PluginInfo", "build_plugin_manager", "get_plugin_host"]


def not_implemented(feature: str, distribution: str) -> NotImplementedError:
    """The error a placeholder raises when used: it must never pretend to work."""
    return NotImplementedError(f"{feature} ({distribution}) is not implemented yet")


def add_placeholder_command(subparsers: Any, name: str, help_text: str, distribution: str) -> None:
    """A subcommand that exists (so discovery is visible) but says it is not implemented yet."""

    def run(_args: Any) -> int:
        print(f"tierwise {name}: {not_implemented(name, distribution)}", file=sys.stderr)
        return 2

    parser = subparsers.add_parser(name, help=f"{help_text} (not implemented yet)")
    parser.set_defaults(func=run)


__all__ += ["add_placeholder_command", "not_implemented"]
