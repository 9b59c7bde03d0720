"""The `tierwise train` subcommand: one flag per TrainOptions field and per tierwise.Config field.

Every flag defaults to "not given" (argparse.SUPPRESS), so the run sees exactly what the user
typed: that is what lets ``--resume`` keep a run's saved options and apply only the new ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing

from tierwise.config import ACTIVATION_OFFLOADS, REDUCE_ORDERS, Config
from tierwise.precision import STATE_PRECISIONS
from tierwise.train.options import TrainOptions, field_docs

CONFIG_FLAG_PREFIX = "config_"
"""Config fields land in the namespace as ``config_<field>`` (``--config`` is the file)."""

EXAMPLES = """\
examples:
  tierwise train                                   # defaults: a small GPT-2 on Python's stdlib
  tierwise train --model llama --size tiny --steps 50 --device-memory 2MiB
  tierwise train --data 'notes/*.md' --tokenizer ./tok --from-pretrained ./my-model
  tierwise train --data chat.jsonl --from-pretrained ./my-model --lora 16   # loss on assistant turns
  tierwise train --host-memory 4MiB --nvme-path /mnt/nvme/tierwise   # needs tierwise-nvme
  tierwise train --activation-offload auto --seq 2048          # keep/recompute/swap per block
  tierwise train --optimizer-states int8           # Adam moments in 8 bits: 6 B/param of states, not 12
  tierwise train --activation-policy 'transformer.h.*=host' --activation-policy 'transformer.h.0=keep'
  tierwise train --resume runs/train-20250101-120000
"""


def _int_or_auto(text: str) -> int | str:
    return text if text == "auto" else int(text)


def _size_or_all(text: str) -> str | None:
    """A byte budget as written ("8GiB"); "all" means what the machine has (None)."""
    return None if text.lower() in ("all", "none") else text


def _parallel(text: str) -> dict[str, int]:
    """ "expert=2,tensor=2" -> {"expert": 2, "tensor": 2}."""
    sizes = {}
    for part in text.split(","):
        name, _, size = part.partition("=")
        sizes[name.strip()] = int(size)
    return sizes


def _policy_entries(text: str) -> dict[str, str]:
    """'model.layers.*=nvme' -> {"model.layers.*": "nvme"}; a .toml file -> its table (top
    level, or under [activation_policy])."""
    if text.endswith(".toml"):
        from pathlib import Path

        import tomllib

        try:
            table = tomllib.loads(Path(text).read_text())
        except (OSError, tomllib.TOMLDecodeError) as err:
            raise argparse.ArgumentTypeError(f"cannot read {text}: {err}") from None
        table = table.get("activation_policy", table)
        if not isinstance(table, dict):
            raise argparse.ArgumentTypeError(f"{text}: expected a table of block pattern = action")
        return {str(k): v for k, v in table.items()}
    pattern, sep, action = text.rpartition("=")
    if not sep or not pattern:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give PATTERN=ACTION (e.g. 'model.layers.*=nvme') or a .toml file"
        )
    return {pattern.strip(): action.strip()}


class _MergePolicy(argparse.Action):
    """--activation-policy is repeatable: later entries are added after (and win over) earlier."""

    def __call__(self, parser, namespace, values, option_string=None):
        merged = dict(getattr(namespace, self.dest, None) or {})
        merged.update(values)
        setattr(namespace, self.dest, merged)


CONFIG_PARSERS = {
    "chunk_size": _int_or_auto,
    "cache_blocks": _int_or_auto,
    "device_memory": _size_or_all,
    "host_memory": _size_or_all,
    "parallel": _parallel,
    "prefetch": int,
    "alloc_fraction": float,
    "frag_factor": float,
}


def _help(doc: str, default: typing.Any = dataclasses.MISSING) -> str:
    """The field's doc, plus its default unless the doc already tells it or there is none."""
    shown = default not in (dataclasses.MISSING, None, False, ()) and "default" not in doc.lower()
    if shown:
        doc += (
            f" (default: {default!r})"
            if isinstance(default, str) and " " in default
            else (f" (default: {default})")
        )
    return doc.replace("%", "%%")


METAVARS = {
    "model_config": "FILE",
    "from_pretrained": "DIR",
    "tokenizer": "DIR",
    "out": "DIR",
    "resume": "DIR",
    "config": "FILE",
    "nvme_path": "DIR",
    "device_memory": "SIZE",
    "host_memory": "SIZE",
    "parallel": "NAME=N[,NAME=N]",
    "prompt": "TEXT",
}


def _add_option(
    group, name: str, hint: typing.Any, doc: str, dest: str, default: typing.Any
) -> None:
    flag = "--" + name.replace("_", "-")
    common = dict(dest=dest, help=_help(doc, default), default=argparse.SUPPRESS)
    if (hint is bool and dest.startswith(CONFIG_FLAG_PREFIX)) or name == "pack":
        group.add_argument(flag, action=argparse.BooleanOptionalAction, **common)
    elif hint is bool:
        group.add_argument(flag, action="store_true", **common)
    elif name == "activation_policy":
        group.add_argument(
            flag,
            type=_policy_entries,
            action=_MergePolicy,
            metavar="PATTERN=ACTION|FILE.toml",
            **common,
        )
    elif name == "activation_offload":
        group.add_argument(flag, choices=ACTIVATION_OFFLOADS, **common)
    elif name == "optimizer_states":
        group.add_argument(flag, choices=STATE_PRECISIONS, **common)
    elif name == "reduce_order":
        group.add_argument(flag, choices=REDUCE_ORDERS, **common)
    elif name == "data":
        group.add_argument(flag, nargs="+", action="extend", metavar="PATH", **common)
    else:
        types = [t for t in typing.get_args(hint) if t is not type(None)] or [hint]
        parse = CONFIG_PARSERS.get(name) if dest.startswith(CONFIG_FLAG_PREFIX) else None
        parse = parse or (types[0] if types[0] in (int, float) else str)
        default_metavar = {int: "N", float: "X"}.get(types[0], name.split("_")[-1].upper())
        group.add_argument(flag, type=parse, metavar=METAVARS.get(name, default_metavar), **common)


def add_train_command(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `tierwise train` (func(args) -> exit code)."""
    parser = subparsers.add_parser(
        "train",
        help="train or fine-tune a causal LM bigger than your device (the main job)",
        description="Train a causal language model with tierwise: the plan is chosen from a "
        "profile of the model and the machine, model data moves between device, host and NVMe.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train_hints = typing.get_type_hints(TrainOptions)
    train_docs = field_docs(TrainOptions)
    group = parser.add_argument_group("run")
    for field in dataclasses.fields(TrainOptions):
        _add_option(
            group,
            field.name,
            train_hints[field.name],
            train_docs[field.name],
            field.name,
            field.default,
        )
    config_hints = typing.get_type_hints(Config)
    config_docs = field_docs(Config)
    group = parser.add_argument_group("engine (tierwise.Config fields)")
    for field in dataclasses.fields(Config):
        doc = config_docs.get(field.name, "")
        if field.name in ("device_memory", "host_memory"):
            doc += ' "all": what the machine has.'
        if field.name == "saves_weights":
            doc += (
                " tierwise train itself never calls save_pretrained (tierwise export writes "
                "from the run's checkpoints): here it only adds the check."
            )
        if field.name == "parallel":
            doc = "Model-parallel sizes by pattern name, e.g. expert=2 or tensor=2."
        if field.name == "device_memory":
            doc += (
                " Default here: the whole device, except for a random-init model on the CPU: "
                "half the model's data, so that host offload is exercised."
            )
        _add_option(
            group,
            field.name,
            config_hints[field.name],
            doc,
            CONFIG_FLAG_PREFIX + field.name,
            field.default,
        )
    parser.set_defaults(func=_run)
    return parser


def _run(args: argparse.Namespace) -> int:
    from tierwise.train.run import main

    given = {k: v for k, v in vars(args).items() if k not in ("func", "command")}
    train = {k: v for k, v in given.items() if not k.startswith(CONFIG_FLAG_PREFIX)}
    config = {
        k.removeprefix(CONFIG_FLAG_PREFIX): v
        for k, v in given.items()
        if k.startswith(CONFIG_FLAG_PREFIX)
    }
    return main(train, config)
