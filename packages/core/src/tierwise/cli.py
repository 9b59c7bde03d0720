"""The ``tierwise`` command. Core adds ``plugins`` (and ``train``); plugins add more via a hook."""

from __future__ import annotations

import argparse
import json
import sys
import typing
from dataclasses import asdict

from tierwise._version import __version__


def _cmd_plugins(args: argparse.Namespace) -> int:
    from tierwise.plugins import get_plugin_host

    infos = get_plugin_host().infos()
    if args.json:
        print(json.dumps([asdict(info) for info in infos], indent=1))
        return 0
    rows = [("plugin", "distribution", "version", "registers")]
    for info in infos:
        parts = []
        if info.tiers:
            parts.append("tiers: " + ", ".join(info.tiers))
        if info.patterns:
            parts.append("patterns: " + ", ".join(info.patterns))
        other = [h.removeprefix("tierwise_") for h in info.hooks if "register" not in h]
        if other:
            parts.append("hooks: " + ", ".join(other))
        rows.append((info.name, info.distribution, info.version, "; ".join(parts) or "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print(
            "  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths, strict=True))
            + "  "
            + row[3]
        )
    for name, cls in sorted(get_plugin_host().tier_classes().items()):
        note = cls.environment_note()
        if note:
            print(f"note: {name} tier: {note}")
    return 0


class Parser(argparse.ArgumentParser):
    """argparse with errors on one line, naming the (sub)command they belong to; every
    subcommand's parser is one of these too (``add_parser`` uses the parent's class)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the options)\n")


def build_parser() -> Parser:
    from tierwise.plugins import get_plugin_host

    parser = Parser(
        prog="tierwise",
        description="Train models bigger than your device: chunks across device, host and NVMe.",
    )
    parser.add_argument("--version", action="version", version=f"tierwise {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    plugins = subparsers.add_parser("plugins", help="list installed plugins and what they add")
    plugins.add_argument("--json", action="store_true", help="machine-readable output")
    plugins.set_defaults(func=_cmd_plugins)
    try:
        from tierwise.train.cli import add_train_command
    except ImportError:  # the train command lands with its own module
        pass
    else:
        add_train_command(subparsers)
        from tierwise.train.export import add_export_command

        add_export_command(subparsers)
    get_plugin_host().add_cli_commands(subparsers=subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the subcommand's flags were misspelled: its error, not the top level's
        command = subcommand_parser(parser, getattr(args, "command", None)) or parser
        command.error(f"unrecognized arguments: {' '.join(unknown)}")
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


def subcommand_parser(parser: argparse.ArgumentParser, name: str | None):
    """The parser of subcommand ``name`` (None when there is none)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(name)
    return None


if __name__ == "__main__":
    sys.exit(main())
