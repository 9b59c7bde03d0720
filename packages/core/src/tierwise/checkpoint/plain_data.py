"""What a checkpoint's ``torch.save`` files may hold: plain data, checked when saved and loaded
without unpickling anything else.

[Note: checkpoints hold plain data]
A checkpoint directory may come from someone else (a shared run directory, a downloaded resume
point), and the checksums in its manifest come with it, so they vouch for nothing. Unpickling
runs whatever the pickle names, so the files tierwise writes with ``torch.save`` (``engine.pt``:
``Engine.state_dict()``; ``extra-rank*.pt``: ``save_checkpoint(extra=...)``) hold plain data
only: tensors, dicts, lists, tuples, strings, numbers, None (and torch's dtypes, devices and
sizes). They are read with ``torch.load(weights_only=True)``, which refuses anything else
before running it, and :func:`check_plain` refuses it when saving, so a run learns at its save,
not at its resume, that what it saves could not be loaded.
"""

from __future__ import annotations

import pickle
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from tierwise.checkpoint.manifest import CheckpointError

PLAIN_VALUES = (
    str,
    int,
    float,
    bool,
    complex,
    bytes,
    type(None),
    torch.dtype,
    torch.device,
    torch.Size,
    torch.Tensor,
    torch.nn.Parameter,
)
"""Types (exact: not subclasses, which pickle by their class) ``torch.load(weights_only=True)``
reads back without running code."""

PLAIN_CONTAINERS = (dict, OrderedDict, list, tuple)


def plain_data_problem(value: Any, where: str) -> str | None:
    """Where ``value`` holds something that is not plain data, e.g. ``"extra['rng'][1] is a
    numpy.ndarray"``; None when all of it is."""
    kind = type(value)
    if kind in PLAIN_VALUES:
        return None
    if kind not in PLAIN_CONTAINERS:
        return f"{where} is a {kind.__module__}.{kind.__qualname__}"
    if isinstance(value, dict):
        for key, item in value.items():
            if type(key) not in PLAIN_VALUES:
                return f"{where} has a key of type {type(key).__module__}.{type(key).__qualname__}"
            problem = plain_data_problem(item, f"{where}[{key!r}]")
            if problem is not None:
                return problem
        return None
    for i, item in enumerate(value):
        problem = plain_data_problem(item, f"{where}[{i}]")
        if problem is not None:
            return problem
    return None


def check_plain(value: Any, where: str, *, saving: str) -> None:
    """Raise :class:`CheckpointError` when ``value`` (called ``where``) is not plain data;
    ``saving``: the checkpoint being written, for the message."""
    problem = plain_data_problem(value, where)
    if problem is not None:
        raise CheckpointError(
            f"save_checkpoint {saving}: {problem}, not plain data (tensors, dicts, lists, "
            "tuples, strings, numbers, None): a checkpoint holds only what loads without "
            "running code; convert it (e.g. a numpy array to a tensor)"
        )


def load_plain(folder: Path, name: str, *, mmap: bool = False) -> Any:
    """``folder/name`` (a ``torch.save`` file, checked against the manifest) read without
    unpickling anything but plain data; :class:`CheckpointError` in one line when it holds
    something else ([Note: checkpoints hold plain data])."""
    try:
        return torch.load(Path(folder) / name, mmap=mmap, weights_only=True)
    except pickle.UnpicklingError as err:
        named = re.search(r"GLOBAL (\S+)", str(err))
        what = f" ({named.group(1)})" if named else ""
        raise CheckpointError(
            f"checkpoint {folder}: {name} holds something other than plain data{what}, which "
            "tierwise never writes there; refused, since unpickling it could run any code"
        ) from None
