"""Plugin hook specifications for tierwise.

Every hook is called with keyword arguments only, through the typed wrapper methods of
:class:`tierwise.plugins.PluginHost`. Each docstring follows one template: a summary line,
``Params:`` naming every argument, ``Returns:`` and, for firstresult hooks, the sentence
"Stops at first non-None result.".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # import-light: plugins import this module at entry-point load time
    import argparse
    from collections.abc import Callable

    import torch

    from tierwise.config import Config
    from tierwise.hardware import Hardware
    from tierwise.plan import Plan
    from tierwise.profile import Profile

PROJECT_NAME = "tierwise"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def tierwise_register_tiers() -> list[type]:
    """Register memory tier classes (subclasses of ``tierwise.tiers.Tier``).

    Params: none.
    Returns: a list of classes, each carrying a unique ``PLUGIN_NAME`` (e.g. "nvme").
    """


@hookspec
def tierwise_register_parallel_patterns() -> list[type]:
    """Register parallel pattern classes (subclasses of ``tierwise.parallel.ParallelPattern``).

    Params: none.
    Returns: a list of classes, each carrying a unique ``PLUGIN_NAME`` (e.g. "expert").
    """


@hookspec
def tierwise_register_settings() -> list[type]:
    """Register settings classes: the Config keys this plugin owns, with their validation.

    Params: none.
    Returns: a list of frozen kw-only dataclasses, each carrying a unique ``PLUGIN_NAME`` (e.g.
    "nvme"). Every field is a key that ``tierwise.config.PluginSettings`` declares for this
    plugin, with the same default and a docstring; ``__post_init__`` raises
    ``tierwise.config.ConfigError.for_field(...)`` for a value the plugin cannot use and may
    normalise one. Config builds the class with the keys the user set, when it is built
    ([Note: plugin-owned settings] in ``tierwise.config``).
    """


@hookspec(firstresult=True)
def tierwise_profile_model(
    model: torch.nn.Module, example_batch: Any, config: Config
) -> Profile | None:
    """Profile a model before runtime (call order, activations, FLOPs, buffers).

    Params: ``model`` the user's module (may be on the meta device); ``example_batch`` one batch
    as the training loop will pass it, or None when unknown; ``config`` the validated Config.
    Returns: a ``tierwise.profile.Profile``, or None to let another plugin (or core's warm-up
    trace) do it.
    Stops at first non-None result.
    """


@hookspec(firstresult=True)
def tierwise_make_plan(
    profile: Profile, hardware: Hardware, config: Config, tier_classes: dict[str, type]
) -> Plan | None:
    """Choose a plan (chunk size, cache blocks, per-chunk tiers, activation policy).

    Params: ``profile`` what the model does; ``hardware`` what the machine can do;
    ``config`` the user's intent and budgets; ``tier_classes`` the registered tier classes by
    name (a storage tier's own host buffers count in the host need: [Note: storage tiers' host
    buffers]; a hookimpl may leave this parameter out).
    Returns: a ``tierwise.plan.Plan``, or None to defer to the next planner.
    Stops at first non-None result.
    """


@hookspec
def tierwise_probe_hardware(config: Config) -> dict[str, Any] | None:
    """Measure or report hardware facts this plugin knows (bandwidths, capacities, velocities).

    Params: ``config`` the validated Config (device, nvme_path, budgets).
    Returns: a dict of ``tierwise.hardware.Hardware`` field names to values, or None.
    """


@hookspec(firstresult=True)
def tierwise_memory_tracer(device: torch.device, model_bytes: Callable[[], int]) -> Any | None:
    """Make a tracer of non-model memory for the engine's warm-up step.

    Params: ``device`` the compute device; ``model_bytes`` a callable returning the bytes of
    model data (chunks) the engine holds on ``device`` now.
    Returns: an object with ``start()``, ``mark(moment: str)``, ``stop() -> [(moment, bytes)]``
    and a ``paused()`` context manager (the engine's own allocations run inside it), or None.
    Stops at first non-None result.
    """


@hookspec
def tierwise_add_cli_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add subcommands to the ``tierwise`` command line.

    Params: ``subparsers`` the argparse sub-parser collection; set ``func`` via
    ``parser.set_defaults(func=callable)`` where ``callable(args) -> int`` is the exit code.
    Returns: nothing.
    """


__all__ = [
    "PROJECT_NAME",
    "hookimpl",
    "hookspec",
    "tierwise_add_cli_commands",
    "tierwise_make_plan",
    "tierwise_memory_tracer",
    "tierwise_probe_hardware",
    "tierwise_profile_model",
    "tierwise_register_parallel_patterns",
    "tierwise_register_settings",
    "tierwise_register_tiers",
]
