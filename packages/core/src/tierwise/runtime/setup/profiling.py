"""Setup stage 2, profile: the model's distinct parameters (tied names merged) and its profile
(a plugin's, ``tierwise_profile_model``, or a static one from module order)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from tierwise.chunks import ChunkGroup
from tierwise.config import Config
from tierwise.parallel import ParallelPattern
from tierwise.plugins import PluginHost
from tierwise.profile import ParamInfo, Profile
from tierwise.runtime.setup.patterns import Patterns
from tierwise.tiers.ledger import return_freed_host_memory


@dataclass
class ManagedParam:
    """A distinct parameter: its first name, aliases, optimizer group and pattern."""

    name: str
    param: torch.nn.Parameter
    aliases: list[str]
    param_group: int
    pattern: ParallelPattern

    @property
    def group_name(self) -> str:
        return ChunkGroup.make_name(self.pattern.key, self.param_group, self.param.requires_grad)


@dataclass(frozen=True, kw_only=True)
class Profiled:
    """What the profile stage found."""

    params: OrderedDict[str, ManagedParam]
    """Distinct parameters by first name, in ``named_parameters`` order."""
    profile: Profile
    """The model's profile, with each parameter's chunk group and data-parallel size."""


def profile_model(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    config: Config,
    *,
    host: PluginHost,
    patterns: Patterns,
    example_batch: Any,
) -> Profiled:
    """The prepared model's distinct parameters and profile; changes nothing on it."""
    params = collect_params(model, optimizer, patterns.patterns)
    profile = host.profile_model(model=model, example_batch=example_batch, config=config)
    return_freed_host_memory()  # [Note: the profile's freed memory]
    if profile is None:
        profile = static_profile(params)
    group_of = {m.name: m.group_name for m in params.values()}
    dp_size_of = {m.name: patterns.dp_size(m.pattern) for m in params.values()}
    for info in profile.params:
        info.group = group_of.get(info.name, info.group)
        info.dp_size = dp_size_of.get(info.name, info.dp_size)
    profile.module_params = profile.module_params or _module_params(model, params)
    return Profiled(params=params, profile=profile)


def collect_params(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, patterns: list[ParallelPattern]
) -> OrderedDict[str, ManagedParam]:
    """Distinct parameters in ``named_parameters`` order, with tied aliases merged."""
    group_of: dict[int, int] = {}
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            group_of[id(p)] = gi
    by_id: dict[int, ManagedParam] = {}
    out: OrderedDict[str, ManagedParam] = OrderedDict()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in by_id:
            by_id[id(param)].aliases.append(name)
            continue
        if getattr(param, "_tierwise_managed", False):
            raise ValueError(
                f"tierwise.setup: parameter {name} is already managed by a tierwise engine; "
                "call setup once per model (build a fresh model to set up again)"
            )
        if param.requires_grad and id(param) not in group_of:
            raise ValueError(
                f"tierwise.setup: trainable parameter {name} is in no optimizer param group; "
                "pass an optimizer over model.parameters(), or freeze it (requires_grad=False)"
            )
        pattern = next(pat for pat in patterns if pat.claims(name, param))
        managed = ManagedParam(name, param, [], group_of.get(id(param), 0), pattern)
        by_id[id(param)] = managed
        out[name] = managed
    if not out:
        raise ValueError("tierwise.setup: the model has no parameters to manage")
    return out


def static_profile(params: OrderedDict[str, ManagedParam]) -> Profile:
    """A profile without running the model: module order stands in for call order."""
    infos = [
        ParamInfo(
            name=m.name,
            shape=tuple(m.param.shape),
            numel=m.param.numel(),
            requires_grad=m.param.requires_grad,
            aliases=tuple(m.aliases),
            group=m.group_name,
        )
        for m in params.values()
    ]
    order = [m.name for m in params.values()]
    return Profile(params=infos, forward_order=order, backward_order=order[::-1], source="static")


def _module_params(model: torch.nn.Module, params) -> dict[str, list[str]]:
    name_of = {id(m.param): m.name for m in params.values()}
    out = {}
    for mod_name, module in model.named_modules():
        names = [name_of[id(p)] for p in module.parameters(recurse=False) if id(p) in name_of]
        if names:
            out[mod_name] = names
    return out
