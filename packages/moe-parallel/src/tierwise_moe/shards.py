"""How a sharded parameter maps to the original one, and full state dicts from shards.

[Note: sharding in place]
Patterns shard modules in place, the way FSDP2 does: each sharded parameter stays the same
``nn.Parameter`` object (so an optimizer built over the unsharded model still holds it) with
``.data`` replaced by this rank's block, and is tagged with a :class:`ShardSpec`; the module's
class is swapped for a generated subclass of its own class whose forward computes across the
model-parallel group (so ``isinstance`` checks, e.g. HF weight initialisation of a model built on
the meta device, still see the original class). The tags are enough to rebuild the original
(HF-loadable) state dict from the shards and to cut a full state dict into this rank's shards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from tierwise.parallel.collectives import Collectives
from tierwise.registry import managed

SPEC_ATTR = "tierwise_shard"
"""Attribute of a sharded ``nn.Parameter`` holding its ShardSpec."""


@dataclass(frozen=True, kw_only=True, eq=False)
class ShardSpec:
    """This rank's block of one parameter: the full tensor cut along ``dim`` into ``size``
    equal contiguous blocks, of which this rank holds block ``rank``."""

    pattern: str
    """PLUGIN_NAME of the pattern that sharded it ("expert", "tensor")."""
    dim: int
    """Dimension along which the full tensor is cut."""
    rank: int
    """Which block this rank holds (0-based)."""
    size: int
    """Number of equal blocks (the model-parallel size)."""
    group: dist.ProcessGroup | None
    """The ranks holding the other blocks, ordered by block (None: size 1)."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"ShardSpec.rank={self.rank} outside 0..{self.size - 1}")

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's block of ``full`` (a view)."""
        if full.dim() <= self.dim or full.shape[self.dim] % self.size:
            raise ValueError(
                f"dimension {self.dim} of a tensor of shape {tuple(full.shape)} does not split "
                f"into {self.size} equal blocks"
            )
        return full.chunk(self.size, dim=self.dim)[self.rank]

    def gather(self, shard: torch.Tensor) -> torch.Tensor:
        """The full tensor from every rank's block (collective over ``group``)."""
        if self.group is None:
            return shard.clone()
        # ``shard`` may be a host copy (a checkpoint's values): the layer moves it to the
        # group's device and back ([Note: collectives on the group's device])
        return torch.cat(Collectives().all_gather_blocks(shard, self.group), dim=self.dim)


def shard_param_(param: torch.nn.Parameter, spec: ShardSpec) -> None:
    """Keep only this rank's block of ``param`` (same Parameter object) and tag it."""
    if getattr(param, SPEC_ATTR, None) is not None:
        raise ValueError(f"parameter of shape {tuple(param.shape)} is already sharded")
    param.data = spec.shard(param.data).clone()
    setattr(param, SPEC_ATTR, spec)


def spec_of(param: torch.Tensor) -> ShardSpec | None:
    """The ShardSpec a pattern tagged ``param`` with (None: not sharded)."""
    return getattr(param, SPEC_ATTR, None)


_SUBCLASSES: dict[tuple[type, type], type] = {}


def swap_class_(module: torch.nn.Module, mixin: type) -> None:
    """Make ``module`` an instance of ``mixin`` + its own class (see [Note: sharding in place])."""
    cls = type(module)
    if isinstance(module, mixin):
        return
    key = (mixin, cls)
    if key not in _SUBCLASSES:
        _SUBCLASSES[key] = type(f"{mixin.__name__}[{cls.__name__}]", (mixin, cls), {})
    module.__class__ = _SUBCLASSES[key]


def shard_specs(model: torch.nn.Module) -> dict[str, ShardSpec]:
    """Every sharded parameter of ``model`` by its full name (tied names included)."""
    return {
        name: spec_of(param)
        for name, param in model.named_parameters(remove_duplicate=False)
        if spec_of(param) is not None
    }


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of the unsharded model (original names and shapes) on every rank.

    For a model managed by ``tierwise.setup`` this is ``model.state_dict()``, which holds the
    whole-model tensors already; for a model only sharded by a pattern's ``prepare`` the blocks
    are gathered here. Collective: every rank must call it.
    """
    if managed(model):
        return model.state_dict()
    specs = shard_specs(model)
    full = {}
    for name, tensor in model.state_dict().items():
        spec = specs.get(name)
        full[name] = tensor.detach().clone() if spec is None else spec.gather(tensor.detach())
    return full


def load_full_state_dict(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Load an unsharded state dict (e.g. from HF) into a sharded model: each rank takes its
    blocks (``model.load_state_dict`` does the same for a model managed by tierwise)."""
    if managed(model):
        model.load_state_dict(state_dict)
        return
    specs = shard_specs(model)
    local = {
        name: (tensor if name not in specs else specs[name].shard(tensor))
        for name, tensor in state_dict.items()
    }
    model.load_state_dict(local)
