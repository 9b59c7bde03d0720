"""Core's own parts, registered through the same hooks as any plugin (plugin name "core")."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tierwise.hookspecs import hookimpl

if TYPE_CHECKING:
    from tierwise.config import Config
    from tierwise.hardware import Hardware
    from tierwise.plan import Plan
    from tierwise.profile import Profile


@hookimpl
def tierwise_register_tiers() -> list[type]:
    from tierwise.tiers import DeviceTier, HostTier

    return [DeviceTier, HostTier]


@hookimpl
def tierwise_register_parallel_patterns() -> list[type]:
    from tierwise.parallel import DataParallel

    return [DataParallel]


@hookimpl(trylast=True)
def tierwise_make_plan(
    profile: Profile, hardware: Hardware, config: Config, tier_classes: dict[str, type]
) -> Plan | None:
    from tierwise.planning.planner import default_plan

    return default_plan(
        profile=profile, hardware=hardware, config=config, tier_classes=tier_classes
    )


@hookimpl(tryfirst=True)
def tierwise_probe_hardware(config: Config) -> dict[str, Any] | None:
    from tierwise.probe import basic_probe

    return basic_probe(config)
