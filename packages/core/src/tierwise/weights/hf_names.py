"""Checkpoint keys to model names: the renamings and conversions transformers'
``from_pretrained`` applies (``transformers.conversion_mapping``), reused as they are.

[Note: checkpoint conversions]
transformers 5 loads legacy layouts by matching each checkpoint key against the model's list of
``WeightRenaming`` / ``WeightConverter`` transforms (``get_model_conversion_mapping``): a
renaming changes the name only; a converter gathers several checkpoint tensors (e.g. one per MoE
expert) and runs its operations (``MergeModulelist``, ``Concatenate``, ...) to make the model's
tensor (e.g. the fused ``mlp.experts.gate_up_proj``). :func:`plan_recipes` does the matching
with transformers' own ``rename_source_key`` and groups the keys as ``from_pretrained`` does
(natural key order, so experts stack in index order); :meth:`Recipe.convert` runs the
converter's operations on the tensors read. Only one recipe's tensors are in memory at a time.
Models that are not transformers models (or without transformers installed) use the keys as
they are.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Recipe:
    """How the model tensor(s) ``targets`` are made from checkpoint keys."""

    targets: list[str]
    """Model names this recipe produces (several for a one-to-many converter)."""
    sources: dict[str, list[str]] = field(default_factory=dict)
    """Source pattern (the key itself without a converter) -> checkpoint keys, in order."""
    converter: Any = None
    """A transformers ``WeightConverter`` (a copy per recipe), or None: the key as it is."""

    @property
    def keys(self) -> list[str]:
        return [key for keys in self.sources.values() for key in keys]

    def convert(
        self,
        read: Callable[[str], torch.Tensor],
        model: torch.nn.Module,
        keep: Callable[[int], bool] | None = None,
    ) -> dict[str, torch.Tensor]:
        """The targets' values; ``read(key)`` gives a checkpoint tensor. ``keep(i)`` (a
        converter whose first operation stacks a list along dimension 0) selects which of each
        list's tensors are read: this rank's experts."""
        if self.converter is None:
            (key,) = self.keys
            return {self.targets[0]: read(key)}
        collected = {}
        for pattern, keys in self.sources.items():
            collected[pattern] = [read(k) for i, k in enumerate(keys) if keep is None or keep(i)]
        converter = self.converter
        for op in converter.operations:
            collected = op.convert(
                collected,
                source_patterns=converter.source_patterns,
                target_patterns=converter.target_patterns,
                full_layer_name=self.targets[0],
                model=model,
                config=getattr(model, "config", None),
                missing_keys=None,
            )
        out = {}
        for pattern, value in collected.items():
            value = value[0] if isinstance(value, list) else value
            name = next((t for t in self.targets if t.endswith(pattern)), None)
            if name is None:
                name = self.targets[0].replace(converter.target_patterns[0], pattern, 1)
            out[name] = value
        return out

    def stacks_dim0(self) -> bool:
        """Whether the converter stacks each source list along dimension 0 first and no later
        operation touches dimension 0 (so a dim-0 slice of the result is a sub-list)."""
        ops = getattr(self.converter, "operations", None)
        if not ops or type(ops[0]).__name__ != "MergeModulelist" or ops[0].dim != 0:
            return False
        return all(type(op).__name__ == "Concatenate" and op.dim != 0 for op in ops[1:])


def plan_recipes(
    keys: list[str], model: torch.nn.Module, model_keys: set[str]
) -> tuple[dict[str, Recipe], list[str]]:
    """Model name -> its recipe (one entry per target), and the checkpoint keys nothing uses."""
    mapping, base_prefix = _conversions(model)
    renamings = [
        t
        for t in mapping
        if type(t).__name__ != "WeightConverter" and hasattr(t, "rename_source_key")
    ]
    converters = [t for t in mapping if type(t).__name__ == "WeightConverter"]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    members = dict.fromkeys(model_keys, True)
    recipes: dict[str, Recipe] = {}
    unused = []
    for key in sorted(keys, key=_natural_key):
        renamed, pattern = _rename(key, renamings, converters, base_prefix, members)
        if renamed not in model_keys and key in model_keys:
            renamed, pattern = key, None
        if renamed not in model_keys:
            unused.append(key)
            continue
        if pattern is None:
            if renamed in recipes:
                unused.append(key)  # a second key for the same tensor: the first wins, as in HF
                continue
            recipes[renamed] = Recipe([renamed], {key: [key]})
            continue
        recipe = recipes.get(renamed)
        if recipe is None:
            converter = copy.deepcopy(by_pattern[pattern])
            targets = [renamed]
            for other in converter.target_patterns[1:]:
                targets.append(renamed.replace(converter.target_patterns[0], other, 1))
            recipe = Recipe(targets, {}, converter)
            for target in targets:
                recipes[target] = recipe
        recipe.sources.setdefault(pattern, []).append(key)
    return recipes, unused


def ignored_unexpected(model: torch.nn.Module) -> list[re.Pattern]:
    """The model's own list of checkpoint keys ``from_pretrained`` ignores when unexpected."""
    return [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]


def _conversions(model: torch.nn.Module) -> tuple[list, str | None]:
    if not any(c.__name__ == "PreTrainedModel" for c in type(model).__mro__):
        return [], None
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # an older transformers: names as they are
        return [], getattr(model, "base_model_prefix", None)
    return get_model_conversion_mapping(model), model.base_model_prefix


def _rename(key, renamings, converters, base_prefix, members) -> tuple[str, str | None]:
    if not renamings and not converters and base_prefix is None:
        return key, None
    from transformers.core_model_loading import rename_source_key

    return rename_source_key(key, renamings, converters, base_prefix, members)


def _natural_key(key: str) -> list:
    return [(0, int(part)) if part.isdigit() else (1, part) for part in key.split(".")]
