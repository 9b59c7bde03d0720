"""Weight sources: where ``setup(..., weights=...)`` takes each parameter's values from.

A source is a safetensors checkpoint directory (``save_pretrained`` output: one
``model.safetensors`` or shards with ``model.safetensors.index.json``), a single ``.safetensors``
file, or a callable ``name -> tensor`` (the whole-model value of the parameter of that name; a
``dict`` state dict works too). :func:`open_weights` opens it; :meth:`WeightSource.resolve`
matches it against the model before anything is planned or allocated (missing, unexpected and
mis-shaped tensors are one error that names them) and returns the :class:`ResolvedWeights` that
setup's fill reads from, one tensor at a time ([Note: loading pretrained weights]).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from tierwise.weights.hf_names import Recipe, ignored_unexpected, plan_recipes
from tierwise.weights.safetensors_io import READS, SafetensorsFile, WeightsError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
SHOWN = 5
"""How many names an error lists before "and N more"."""


def _names(items: list[str]) -> str:
    shown = ", ".join(items[:SHOWN])
    return shown + (f" and {len(items) - SHOWN} more" if len(items) > SHOWN else "")


class WeightSource:
    """Checkpoint tensors by key: their shapes without reading them, and reads of a slice.

    ``rename``: model parameter name -> the name the checkpoint knows it by (e.g. a PEFT
    model's ``base_model.model.x.base_layer.weight`` -> ``x.weight``), applied before HF's own
    conversions. ``keep_initialised``: a parameter the checkpoint lacks keeps the values it has
    when it is not on the meta device (LoRA adapters on a pretrained base); by default every
    parameter must come from the checkpoint."""

    description = "weights"
    rename: Callable[[str], str] | None = None
    keep_initialised: bool = False

    def keys(self) -> list[str]:
        raise NotImplementedError

    def shape(self, key: str) -> tuple[int, ...] | None:
        """The stored shape (None: unknown until read)."""
        return None

    def read(self, key: str, dim: int = 0, start: int = 0, stop: int | None = None) -> torch.Tensor:
        raise NotImplementedError

    def resolve(self, model: torch.nn.Module) -> ResolvedWeights:
        """Match the checkpoint to ``model`` (as built, before any pattern shards it). Raises
        :class:`WeightsError` naming every missing, unexpected or mis-shaped tensor."""
        rename = self.rename or (lambda name: name)
        named = list(model.named_parameters(remove_duplicate=False))
        buffers = {
            rename(prefix + ("." if prefix else "") + name)
            for prefix, module in model.named_modules()
            for name, buf in module.named_buffers(recurse=False)
            if name not in getattr(module, "_non_persistent_buffers_set", ())
        }
        model_keys = {rename(n) for n, _ in named} | buffers
        hf_model = next((m for m in model.modules() if _is_hf(m)), model)
        recipes, unused = plan_recipes(self.keys(), hf_model, model_keys)
        ignore = ignored_unexpected(hf_model)
        unexpected = [k for k in unused if not any(p.search(k) for p in ignore)]
        by_param: dict[int, list[str]] = {}
        for name, param in named:
            by_param.setdefault(id(param), []).append(name)
        missing, mismatched, chosen = [], [], {}
        param_of = {n: p for n, p in named}
        for names in by_param.values():
            found = next((rename(n) for n in names if rename(n) in recipes), None)
            if found is None:
                if not (self.keep_initialised and not param_of[names[0]].is_meta):
                    missing.append(names[0])
                continue
            chosen[names[0]] = found
        for first, found in chosen.items():
            recipe = recipes[found]
            if recipe.converter is None:
                stored = self.shape(recipe.keys[0])
                want = tuple(param_of[first].shape)
                if stored is not None and tuple(stored) != want:
                    key = recipe.keys[0]
                    model_side = f"{first} {want}" if key != first else str(want)
                    mismatched.append(f"{key} {tuple(stored)}, model {model_side}")
        problems = []
        if missing:
            problems.append(f"missing {_names(missing)}")
        if unexpected:
            problems.append(f"unexpected {_names(unexpected)}")
        if mismatched:
            problems.append(f"shape mismatch: checkpoint {_names(mismatched)}")
        if problems:
            raise WeightsError(
                f"{self.description} does not match {type(model).__name__}: "
                + "; ".join(problems)
                + " (check that the checkpoint and the model config are the same architecture)"
            )
        buffer_recipes = {
            prefix + ("." if prefix else "") + name: recipes[key]
            for prefix, module in model.named_modules()
            for name, _ in module.named_buffers(recurse=False)
            if (key := rename(prefix + ("." if prefix else "") + name)) in recipes
        }
        return ResolvedWeights(self, hf_model, model, recipes, chosen, buffer_recipes)


class DirectoryWeights(WeightSource):
    """A safetensors checkpoint: a directory (with or without the index) or one file."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        rename: Callable[[str], str] | None = None,
        keep_initialised: bool = False,
    ):
        self.rename, self.keep_initialised = rename, keep_initialised
        path = Path(path)
        self.description = f"checkpoint {path}"
        if path.is_file():
            files = [path]
            weight_map = None
        elif (path / INDEX).is_file():
            try:
                weight_map = json.loads((path / INDEX).read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError):
                raise WeightsError(
                    f"{path / INDEX}: not a safetensors index (no weight_map)"
                ) from None
            files = [path / f for f in sorted(set(weight_map.values()))]
            absent = [str(f) for f in files if not f.is_file()]
            if absent:
                raise WeightsError(
                    f"{path / INDEX} names shard files that are missing: {_names(absent)}"
                )
        elif (path / SINGLE).is_file():
            files, weight_map = [path / SINGLE], None
        elif path.is_dir() and sorted(path.glob("*.safetensors")):
            files, weight_map = sorted(path.glob("*.safetensors")), None
        else:
            raise WeightsError(
                f"{path}: no safetensors weights ({SINGLE}, {INDEX} or *.safetensors); save the "
                "model with save_pretrained (safetensors is its default)"
            )
        self.files = {f.name: SafetensorsFile(f) for f in files}  # headers only: checks truncation
        self.where: dict[str, SafetensorsFile] = {}
        for file in self.files.values():
            for key in file.entries:
                if weight_map is None or weight_map.get(key) == file.path.name:
                    self.where[key] = file
        if weight_map is not None:
            lost = [k for k, f in weight_map.items() if k not in self.where]
            if lost:
                raise WeightsError(
                    f"{path / INDEX} places {_names(lost)} in files that do not hold them"
                )

    def keys(self) -> list[str]:
        return list(self.where)

    def shape(self, key: str) -> tuple[int, ...]:
        return self.where[key].entries[key].shape

    def read(self, key, dim=0, start=0, stop=None):
        return self.where[key].read(key, dim, start, stop)


class CallableWeights(WeightSource):
    """``fn(name)`` gives the whole-model tensor of parameter ``name`` (or a state dict)."""

    def __init__(self, fn: Callable[[str], torch.Tensor] | Mapping[str, torch.Tensor], keys=None):
        self.fn = fn.__getitem__ if isinstance(fn, Mapping) else fn
        self._keys = list(fn.keys()) if isinstance(fn, Mapping) else keys
        self.description = (
            "the weights mapping" if isinstance(fn, Mapping) else "the weights callable"
        )

    def keys(self) -> list[str]:
        return list(self._keys)

    def read(self, key, dim=0, start=0, stop=None):
        value = self.fn(key)
        if not isinstance(value, torch.Tensor):
            raise WeightsError(
                f"{self.description} returned {type(value).__name__} for {key}, not a tensor"
            )
        if stop is not None:
            value = value.narrow(dim, start, stop - start)
        return value

    def resolve(self, model: torch.nn.Module) -> ResolvedWeights:
        if self._keys is None:  # a bare callable answers for every parameter name
            self._keys = list(dict(model.named_parameters()))
        return super().resolve(model)


def _is_hf(module: torch.nn.Module) -> bool:
    return any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers")
        for c in type(module).__mro__
    )


def open_weights(weights: Any) -> WeightSource:
    """A :class:`WeightSource` from what ``setup(weights=...)`` was given."""
    if isinstance(weights, WeightSource):
        return weights
    if isinstance(weights, (str, os.PathLike)):
        return DirectoryWeights(weights)
    if isinstance(weights, Mapping) or callable(weights):
        return CallableWeights(weights)
    raise TypeError(
        f"setup(weights=...) takes a safetensors directory or file, a callable name -> tensor or "
        f"a state dict; got {type(weights).__name__}"
    )


# [Note: loading pretrained weights]
# setup with ``weights=`` never materialises the model: the fill walks the chunks in order and,
# for each parameter slot in this rank's shard of a chunk, reads the part of the parameter that
# falls in the shard (only rows it needs along dimension 0; for a parameter a model-parallel
# pattern split, only this rank's block, along the split dimension: ``local_slice``), converts
# it in pieces to fp32 for the master and to the chunk's precision for its home, writes the
# pieces to the slabs' tiers (NVMe included) and drops it. At most one parameter (one
# converter's outputs for a converted one, e.g. a layer's fused experts and the per-expert
# tensors they are stacked from) is in host memory at once, plus the pieces
# (``runtime.build.FILL_PIECE``). Nothing is written to the model until every chunk is
# filled, so a failure part way releases the slabs and closes the tiers with the model as it was.
class ResolvedWeights:
    """A source matched to a model: reads each parameter's values (or a part of them)."""

    def __init__(
        self, source: WeightSource, hf_model, model, recipes: dict[str, Recipe], chosen, buffers
    ):
        self.source = source
        self.hf_model = hf_model  # what HF's converters are given
        self.model = model
        self.recipes = recipes
        self.chosen = chosen  # first parameter name -> the model name whose recipe gives it
        self.buffers = buffers
        self.slices: dict[str, tuple[int, int, int]] = {}  # name -> (dim, start, stop)
        self._pending: dict[str, torch.Tensor] = {}

    def bind_slices(self, params) -> None:
        """Record each parameter's model-parallel block: ``params`` are (name, param, pattern)."""
        for name, param, pattern in params:
            block = pattern.local_slice(name, param)
            if block is not None:
                self.slices[name] = block[:3]

    def reads_rows(self, name: str) -> bool:
        """Whether ``local_value(name, lo, hi)`` reads only the rows ``lo:hi`` lie in (a stored
        tensor taken as it is, not split by a model-parallel pattern), so a parameter can be
        read a piece at a time without reading any byte twice."""
        if name not in self.chosen:
            return False
        recipe = self.recipes[self.chosen[name]]
        return recipe.converter is None and name not in self.slices

    def local_value(self, name: str, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
        """Elements ``lo:hi`` of this rank's (flattened) value of parameter ``name``, in the
        stored dtype; reads only the rows (and model-parallel block) they lie in."""
        if name not in self.chosen:  # keep_initialised: the parameter's own values
            flat = self._params()[name].detach().reshape(-1)
            return flat if lo is None else flat[lo:hi]
        recipe = self.recipes[self.chosen[name]]
        block = self.slices.get(name)
        if recipe.converter is None:
            key = recipe.keys[0]
            if block is not None:
                dim, start, stop = block
                value = self.source.read(key, dim, start, stop)
            else:
                value = self._rows(key, lo, hi)
                if value is not None:
                    return value
                value = self.source.read(key)
            self._check(name, key, value)
        else:
            value = self._converted(name, recipe, block)
        flat = value.reshape(-1)
        return flat if lo is None else flat[lo:hi]

    def _rows(self, key: str, lo, hi) -> torch.Tensor | None:
        """Elements lo:hi of a whole tensor, reading only the dimension-0 rows they fall in."""
        shape = self.source.shape(key)
        if lo is None or not shape or len(shape) < 1 or shape[0] == 0:
            return None
        row = max(1, int(torch.Size(shape[1:]).numel()))
        first, last = lo // row, -(-hi // row)
        if first == 0 and last >= shape[0]:
            return None
        rows = self.source.read(key, 0, first, last).reshape(-1)
        return rows[lo - first * row : hi - first * row]

    def _converted(self, name: str, recipe: Recipe, block) -> torch.Tensor:
        target = self.chosen[name]
        if target in self._pending:
            return self._pending.pop(target)
        keep = None
        sliced_already = False
        if block is not None and block[0] == 0 and recipe.stacks_dim0():
            keep = lambda i, b=block: b[1] <= i < b[2]  # noqa: E731 - this rank's experts only
            sliced_already = True
        values = recipe.convert(self.source.read, self.hf_model, keep)
        for target_name, value in values.items():
            READS.track(value)
            if target_name != target and target_name in self.recipes:
                self._pending[target_name] = value  # a one-to-many converter's other outputs
        value = values[target]
        if block is not None and not sliced_already:
            dim, start, stop = block
            value = value.narrow(dim, start, stop - start)
        want = self._local_shape(name)
        if tuple(value.shape) != want:
            raise WeightsError(
                f"{self.source.description}: {name} converted from {_names(recipe.keys)} has "
                f"shape {tuple(value.shape)}, the model's is {want}"
            )
        return value

    def _check(self, name: str, key: str, value: torch.Tensor) -> None:
        want = self._local_shape(name)
        if tuple(value.shape) != want:
            raise WeightsError(
                f"{self.source.description}: tensor {key} has shape {tuple(value.shape)}, "
                f"parameter {name} needs {want}"
            )

    def _local_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._params()[name].shape)

    def _params(self) -> dict:
        if not hasattr(self, "_param_cache"):
            self._param_cache = dict(self.model.named_parameters(remove_duplicate=False))
        return self._param_cache

    def load_buffers(self) -> None:
        """Persistent buffers the checkpoint holds (small: read whole)."""
        for name, recipe in self.buffers.items():
            module_name, _, attr = name.rpartition(".")
            module = self.model.get_submodule(module_name)
            value = next(iter(recipe.convert(self.source.read, self.hf_model).values()))
            current = getattr(module, attr)
            setattr(
                module,
                attr,
                value.to(
                    device=current.device if not current.is_meta else "cpu", dtype=current.dtype
                ),
            )

    def close(self) -> None:
        self._pending.clear()
