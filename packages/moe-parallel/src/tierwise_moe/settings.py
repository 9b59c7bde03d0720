"""MoESettings: the Config keys tierwise-moe owns, with their checks.

Registered through ``tierwise_register_settings``; Config hands it the keys the user set
([Note: plugin-owned settings] in ``tierwise.config``). Light: the entry point imports it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierwise.config import ConfigError


@dataclass(frozen=True, kw_only=True)
class MoESettings:
    """How experts route. The base settings route exactly."""

    PLUGIN_NAME = "moe"

    expert_capacity_factor: float | None = None
    """Expert parallel: None routes exactly (no token dropped); a factor f caps each expert at
    ceil(f · routed pairs / experts) rows per rank and drops the rest."""

    def __post_init__(self) -> None:
        factor = self.expert_capacity_factor
        if factor is not None and not (isinstance(factor, (int, float)) and factor > 0):
            raise ConfigError.for_field(
                "expert_capacity_factor",
                factor,
                "give a positive factor (1.25 is common) or None for exact routing",
            )
