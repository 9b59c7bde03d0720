"""tierwise-search: the cost model and automatic plan search.

Implements ``tierwise_make_plan`` (ahead of core's trylast default planner) and adds the
``tierwise plan`` command.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tierwise.hookspecs import hookimpl

from tierwise_search._version import __version__

if TYPE_CHECKING:
    from tierwise.config import Config
    from tierwise.hardware import Hardware
    from tierwise.plan import Plan
    from tierwise.profile import Profile


@hookimpl
def tierwise_make_plan(profile: Profile, hardware: Hardware, config: Config) -> Plan | None:
    from tierwise_search.search import search_plan

    return search_plan(profile, hardware, config)


@hookimpl
def tierwise_add_cli_commands(subparsers) -> None:
    from tierwise_search.cli import add_plan_command

    add_plan_command(subparsers)


__all__ = ["__version__", "tierwise_add_cli_commands", "tierwise_make_plan"]
