"""tierwise-search: the cost model and automatic plan search."""

from __future__ import annotations

from tierwise.hookspecs import hookimpl
from tierwise.plugins import add_placeholder_command

from tierwise_search._version import __version__


@hookimpl
def tierwise_add_cli_commands(subparsers) -> None:
    add_placeholder_command(subparsers, "plan", "search the best plan for a model", "tierwise-search")


__all__ = ["__version__", "tierwise_add_cli_commands"]
