"""How a sharded parameter maps to the original one, and full state dicts from shards.

Sharded modules (experts, column/row linears) keep the original parameter names and record, per
parameter, a :class:`ShardSpec`: the full tensor is cut along ``dim`` into ``size`` equal
contiguous blocks and this rank holds block ``rank``. That is enough to rebuild the original
(HF-loadable) state dict from the shards and to cut a full state dict into this rank's shards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

SPECS_ATTR = "tierwise_shard_specs"
"""Attribute of a sharded module: dict of its parameter attribute name -> ShardSpec."""


@dataclass(frozen=True, kw_only=True, eq=False)
class ShardSpec:
    """This rank's block of one parameter."""

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
        if full.shape[self.dim] % self.size:
            raise ValueError(
                f"dimension {self.dim} of a tensor of shape {tuple(full.shape)} does not split "
                f"into {self.size} equal blocks"
            )
        return full.chunk(self.size, dim=self.dim)[self.rank]

    def gather(self, shard: torch.Tensor) -> torch.Tensor:
        """The full tensor from every rank's block (collective over ``group``)."""
        if self.group is None:
            return shard.clone()
        blocks = [torch.empty_like(shard) for _ in range(self.size)]
        dist.all_gather(blocks, shard.contiguous(), group=self.group)
        return torch.cat(blocks, dim=self.dim)


def shard_specs(model: torch.nn.Module) -> dict[str, ShardSpec]:
    """Every sharded parameter of ``model`` by its full name."""
    specs = {}
    for module_name, module in model.named_modules():
        for attr, spec in getattr(module, SPECS_ATTR, {}).items():
            specs[f"{module_name}.{attr}" if module_name else attr] = spec
    return specs


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of the unsharded model (original names and shapes) on every rank.

    Collective: every rank of the run must call it (shards are all-gathered in name order).
    """
    specs = shard_specs(model)
    full = {}
    for name, tensor in model.state_dict().items():
        spec = specs.get(name)
        full[name] = tensor.detach().clone() if spec is None else spec.gather(tensor.detach())
    return full


def load_full_state_dict(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Load an unsharded state dict (e.g. from HF) into a sharded model: each rank takes its
    blocks. No communication."""
    specs = shard_specs(model)
    local = {
        name: (tensor if name not in specs else specs[name].shard(tensor))
        for name, tensor in state_dict.items()
    }
    model.load_state_dict(local)
