"""Profile a deep model from a config by profiling two short copies of it and replicating a layer.

Used by ``tierwise profile`` (tierwise-profiler) and ``tierwise plan`` (tierwise-search): it only
reshapes Profiles, whatever made them, so it lives in core.

[Note: layer replication] A stack of identical decoder layers profiles the same way whatever its
depth: every layer adds the same parameters, call-order run, module entries, FLOPs and saved
activations, and the peak activation memory grows by the same amount per layer. So a model of L
layers is profiled as two copies with 3 and 4 layers (a second instead of many for OPT-175B):
layer 1 of the 3-layer profile is the template for layers 1..L-2 (the first and the last layer
may differ: the last layer's output is attributed to the final norm), and peak activations and
buffer bytes are extrapolated linearly from the two copies. The 3-layer profile expanded to 4
layers must equal the real 4-layer profile (orders, modules, blocks, FLOPs, activations); if it
does not, or the config's layers differ (``layer_types``, MoE every other layer, dense first
layers), the model is profiled whole instead.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from tierwise.profile import ParamInfo, Profile

if TYPE_CHECKING:
    import torch

UNIFORM_MODEL_TYPES = ("gpt2", "opt", "llama", "mistral", "qwen2", "qwen2_moe", "mixtral")
"""Families whose decoder layers are identical unless the config says otherwise."""
SHORT = (3, 4)
"""Depths of the two copies that are really profiled."""


def replicable(config) -> bool:
    """Whether ``config``'s layers are identical (and deep enough for replication to pay)."""
    if getattr(config, "model_type", None) not in UNIFORM_MODEL_TYPES:
        return False
    if getattr(config, "num_hidden_layers", 0) <= SHORT[-1]:
        return False
    types = getattr(config, "layer_types", None)
    if types is not None and len(set(types)) > 1:
        return False
    if getattr(config, "mlp_only_layers", None):
        return False
    return getattr(config, "decoder_sparse_step", 1) in (None, 1)


def with_layers(config, layers: int):
    """A copy of ``config`` with ``layers`` decoder layers (of its one layer type)."""
    short = copy.deepcopy(config)
    short.num_hidden_layers = layers
    types = getattr(short, "layer_types", None)
    if types:
        short.layer_types = [types[0]] * layers
    return short


def layer_list(model: torch.nn.Module, layers: int) -> str:
    """Qualified name of the ModuleList holding the ``layers`` decoder layers ("" if none)."""
    import torch

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == layers:
            return name
    return ""


def profile_by_replication(
    config, profile: Callable[[object], tuple[Profile, str]]
) -> Profile | None:
    """The profile of ``config`` from 3- and 4-layer copies, or None when the copies do not
    replicate (see [Note: layer replication]). ``profile(config)`` returns the profile of a
    model built from ``config`` and the qualified name of its ModuleList of layers."""
    (short, prefix), (longer, prefix_longer) = (profile(with_layers(config, n)) for n in SHORT)
    if not prefix or prefix != prefix_longer:
        return None
    grown = expand(short, prefix, SHORT[-1], longer)
    if grown is None or not _same_structure(grown, longer):
        return None
    return expand(short, prefix, config.num_hidden_layers, longer)


def expand(short: Profile, prefix: str, layers: int, longer: Profile) -> Profile | None:
    """``short`` (``SHORT[0]`` layers) grown to ``layers`` layers by copying layer 1 (the first
    and the last layer can differ from the middle ones: the embedding's output feeds the first,
    the last's output is the final norm's input); peak activations and buffer bytes
    extrapolated from ``short`` and ``longer`` (one more layer)."""
    n = SHORT[0]
    extra = layers - n  # copies of layer 1 beyond the one ``short`` has

    def layer_of(name: str) -> int | None:
        if not name.startswith(prefix + "."):
            return None
        head = name[len(prefix) + 1 :].split(".", 1)[0]
        return int(head) if head.isdigit() else None

    def rename(name: str, index: int) -> str:
        head = name[len(prefix) + 1 :].split(".", 1)
        return f"{prefix}.{index}" + (f".{head[1]}" if len(head) > 1 else "")

    def copies(name: str) -> list[str]:
        """``name`` in the grown model: layer 1 becomes layers 1..1+extra, later layers move up."""
        layer = layer_of(name)
        if layer is None or layer == 0:
            return [name]
        if layer == 1:
            return [rename(name, i) for i in range(1, 2 + extra)]
        return [rename(name, layer + extra)]

    def grow(names: list[str]) -> list[str] | None:
        runs = [i for i, name in enumerate(names) if layer_of(name) == 1]
        if not runs:
            return [c for name in names for c in copies(name)]
        start, end = runs[0], runs[-1] + 1
        if end - start != len(runs):  # the layer is not one contiguous run
            return None
        first = [i for i, name in enumerate(names) if layer_of(name) == 0]
        ascending = not first or first[0] < start
        order = range(1, 2 + extra) if ascending else range(1 + extra, 0, -1)
        run = names[start:end]
        middle = [rename(name, i) for i in order for name in run]
        outside = lambda part: [c for name in part for c in copies(name)]  # noqa: E731
        return outside(names[:start]) + middle + outside(names[end:])

    forward, backward = grow(short.forward_order), grow(short.backward_order)
    multi_use = grow(short.multi_use)
    if forward is None or backward is None or multi_use is None:
        return None
    params: list[ParamInfo] = []
    for info in short.params:
        for index, name in enumerate(copies(info.name)):
            aliases = tuple(
                (copies(a)[index] if len(copies(a)) > 1 else copies(a)[0]) for a in info.aliases
            )
            params.append(replace(info, name=name, aliases=aliases))
    params = _in_registration_order(params, layer_of)

    def grow_dict(values: dict, more: dict | None = None) -> dict:
        """Layer entries copied; a number outside the layers that changes with depth (a mask
        the model builds for all layers) extrapolated from ``more`` (the longer copy's)."""
        out = {}
        for key, value in values.items():
            if more is not None and layer_of(key) is None and key in more:
                value = value + extra * (more[key] - value)
            names = copies(key)
            if not isinstance(value, list):
                out.update(dict.fromkeys(names, value))
            elif len(names) == 1:
                out[names[0]] = [copies(v)[0] for v in value]
            else:  # a layer-1 module: its own copy of each of its layer-1 names
                for index, name in zip(range(1, 2 + extra), names, strict=True):
                    out[name] = [
                        rename(v, index) if layer_of(v) == 1 else copies(v)[0] for v in value
                    ]
        return out

    def grow_with_depth(values: dict[str, int], more: dict[str, int]) -> dict[str, int]:
        """A figure that grows with the layers before a module (a backward peak holds the saved
        activations of every earlier layer): each copy or moved layer gets the growth per layer
        seen between ``values`` and ``more`` (the longer copy's) times the layers added before
        it; layer 0 stays, modules outside the layers extrapolate as ``grow_dict`` does."""
        out: dict[str, int] = {}
        for key, value in values.items():
            layer = layer_of(key)
            if layer is None:
                out[key] = value + extra * (more.get(key, value) - value)
            elif layer == 0:
                out[key] = value
            else:
                step = more.get(rename(key, layer + 1), value) - value
                if layer == 1:
                    for index in range(1, 2 + extra):
                        out[rename(key, index)] = value + (index - 1) * step
                else:
                    out[rename(key, layer + extra)] = value + extra * step
        return out

    def block_layer(block: list[str]) -> int | None:
        found = {layer_of(name) for name in block}
        return found.pop() if len(found) == 1 else None

    # blocks are listed in the order backward re-runs them (last layer first)
    first = [i for i, block in enumerate(short.checkpoint_blocks) if block_layer(block) == 0]
    blocks = []
    for position, block in enumerate(short.checkpoint_blocks):
        layer = block_layer(block)
        if layer == 1:
            ascending = not first or first[0] < position
            order = range(1, 2 + extra) if ascending else range(1 + extra, 0, -1)
            blocks += [[rename(name, i) for name in block] for i in order]
        else:
            blocks.append([c for name in block for c in copies(name)])
    per_layer_peak = longer.peak_activation_bytes - short.peak_activation_bytes
    per_layer_buffers = longer.buffer_bytes - short.buffer_bytes
    saved = grow_dict(short.layer_activation_bytes, longer.layer_activation_bytes)
    # [Note: peak above saved] the peak is the largest of the step's moments; the two copies'
    # peaks may fall at different moments (a block's backward in one, the loss in the other), so
    # their difference can grow slower than the saved activations do. Every step holds all saved
    # activations at the end of forward plus what the longer copy needed on top of its own there
    # (the head and loss), so the grown peak is at least that.
    headroom = max(longer.peak_activation_bytes - sum(longer.layer_activation_bytes.values()), 0)
    peak = max(short.peak_activation_bytes + extra * per_layer_peak, sum(saved.values()) + headroom)
    return replace(
        short,
        params=params,
        forward_order=forward,
        backward_order=backward,
        module_params=grow_dict(short.module_params),
        checkpoint_blocks=blocks,
        multi_use=multi_use,
        layer_activation_bytes=saved,
        layer_flops=grow_dict(short.layer_flops, longer.layer_flops),
        layer_forward_s=grow_dict(short.layer_forward_s, longer.layer_forward_s),
        layer_matmul_s=grow_dict(short.layer_matmul_s, longer.layer_matmul_s),
        layer_backward_s=grow_dict(short.layer_backward_s, longer.layer_backward_s),
        layer_ops=grow_dict(short.layer_ops),
        peak_activation_bytes=peak,
        module_input_bytes=grow_dict(short.module_input_bytes, longer.module_input_bytes),
        backward_peak_bytes=grow_with_depth(short.backward_peak_bytes, longer.backward_peak_bytes),
        buffer_bytes=short.buffer_bytes + extra * per_layer_buffers,
        seconds=short.seconds + longer.seconds,
    )


def _in_registration_order(params: list[ParamInfo], layer_of) -> list[ParamInfo]:
    """Layer parameters sorted by layer index, the rest where they were (named_parameters
    order: everything before the layers, the layers, everything after)."""
    first = next((i for i, p in enumerate(params) if layer_of(p.name) is not None), None)
    if first is None:
        return params
    in_layers = [p for p in params if layer_of(p.name) is not None]
    rest = [p for p in params if layer_of(p.name) is None]
    in_layers.sort(key=lambda p: layer_of(p.name))  # stable: keeps each layer's own order
    return rest[:first] + in_layers + rest[first:]


def _same_structure(a: Profile, b: Profile) -> bool:
    return (
        [p.name for p in a.params] == [p.name for p in b.params]
        and [p.numel for p in a.params] == [p.numel for p in b.params]
        and a.forward_order == b.forward_order
        and a.backward_order == b.backward_order
        and a.module_params == b.module_params
        and a.checkpoint_blocks == b.checkpoint_blocks
        and a.layer_flops == b.layer_flops
        and a.layer_ops == b.layer_ops
        and a.layer_activation_bytes == b.layer_activation_bytes
        and a.peak_activation_bytes == b.peak_activation_bytes
        and a.buffer_bytes == b.buffer_bytes
    )


__all__ = ["expand", "layer_list", "profile_by_replication", "replicable", "with_layers"]
