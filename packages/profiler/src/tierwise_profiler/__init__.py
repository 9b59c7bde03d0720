"""tierwise-profiler: pre-runtime model profile, hardware probe, runtime memory tracer."""

from __future__ import annotations

from tierwise.hookspecs import hookimpl
from tierwise.plugins import add_placeholder_command

from tierwise_profiler._version import __version__


@hookimpl
def tierwise_add_cli_commands(subparsers) -> None:
    add_placeholder_command(subparsers, "profile", "profile a model before runtime", "tierwise-profiler")
    add_placeholder_command(subparsers, "probe", "measure this machine's bandwidths", "tierwise-profiler")


__all__ = ["__version__", "tierwise_add_cli_commands"]
