"""The "tensor" pattern: Megatron column/row-parallel linears for Llama-style attention and MLP.

Attention: q/k/v are column-parallel (each rank computes its share of the heads; the attention
itself runs on local heads unchanged), o is row-parallel. MLP: gate/up column-parallel, down
row-parallel. One all-reduce in forward per block (after the row-parallel linear) and one per
column-parallel input in backward. Ranks of a tensor-parallel group must get the same batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tierwise_moe.collectives import copy_to_group, reduce_from_group
from tierwise_moe.pattern import ModelParallelPattern
from tierwise_moe.shards import ShardSpec, shard_param_, swap_class_

ATTENTION_PROJS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJS = ("gate_proj", "up_proj", "down_proj")


class ColumnParallelLinear(torch.nn.Module):
    """Mixin for an nn.Linear whose output features are split: rank r computes features
    [r*out/P, (r+1)*out/P) from all of x. Made with :func:`shard_linear_`."""

    tp_group: dist.ProcessGroup | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_group(x, self.tp_group), self.weight, self.bias)


class RowParallelLinear(torch.nn.Module):
    """Mixin for an nn.Linear whose input features are split: rank r multiplies its slice of x
    and the partial sums are all-reduced. The bias stays whole on every rank (not sharded, so
    data parallelism owns it) and is added once, after the reduction."""

    tp_group: dist.ProcessGroup | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = reduce_from_group(F.linear(x, self.weight), self.tp_group)
        return out if self.bias is None else out + self.bias


def shard_linear_(linear: torch.nn.Linear, kind: type, *, rank: int, size: int, group) -> None:
    """Make ``linear`` a ColumnParallelLinear or RowParallelLinear holding block ``rank``."""
    column = kind is ColumnParallelLinear
    spec = ShardSpec(pattern="tensor", dim=0 if column else 1, rank=rank, size=size, group=group)
    shard_param_(linear.weight, spec)
    if column and linear.bias is not None:
        shard_param_(linear.bias, spec)
    linear.out_features, linear.in_features = linear.weight.shape
    swap_class_(linear, kind)
    linear.tp_group = group


def _has_linears(module: torch.nn.Module, names: tuple[str, ...]) -> bool:
    return all(isinstance(getattr(module, name, None), torch.nn.Linear) for name in names)


def _is_sharded(linear: torch.nn.Module) -> bool:
    return isinstance(linear, (ColumnParallelLinear, RowParallelLinear))


class TensorParallel(ModelParallelPattern):
    """Tensor parallelism (Megatron) for Llama-style attention and gated MLPs.

    Every module with ``q_proj, k_proj, v_proj, o_proj`` linears and a ``head_dim`` (attention)
    or ``gate_proj, up_proj, down_proj`` linears (MLP) is split over the P consecutive ranks of
    a tensor-parallel group. Embeddings, norms and the LM head stay data-parallel. The ranks of a
    tensor-parallel group must be fed the same batch; :meth:`dp_group` (ranks holding the same
    shard) is where the batch differs.
    """

    PLUGIN_NAME = "tensor"

    def _shard_modules(self, model: torch.nn.Module) -> None:
        attention = [
            (name, module)
            for name, module in model.named_modules()
            if _has_linears(module, ATTENTION_PROJS) and hasattr(module, "head_dim")
        ]
        mlps = [
            (name, module)
            for name, module in model.named_modules()
            if _has_linears(module, MLP_PROJS)
        ]
        if not attention and not mlps:
            raise ValueError(
                f"tensor parallelism found no Llama-style attention (q/k/v/o_proj) or gated MLP "
                f"(gate/up/down_proj) in {type(model).__name__}; drop 'tensor' from parallel"
            )
        for name, module in attention:
            if not _is_sharded(module.q_proj):  # prepare() is idempotent
                head_dim = module.head_dim
                self._check_divides(
                    name, "num_attention_heads", module.q_proj.out_features // head_dim
                )
                self._check_divides(
                    name, "num_key_value_heads", module.k_proj.out_features // head_dim
                )
                self._split(module, column=("q_proj", "k_proj", "v_proj"), row="o_proj")
        for name, module in mlps:
            if not _is_sharded(module.gate_proj):
                self._check_divides(name, "intermediate size", module.gate_proj.out_features)
                self._split(module, column=("gate_proj", "up_proj"), row="down_proj")

    def _split(self, module, *, column: tuple[str, ...], row: str) -> None:
        mesh = self.mesh
        where = dict(rank=mesh.mp_rank, size=mesh.mp_size, group=mesh.mp_group)
        for attr in column:
            shard_linear_(getattr(module, attr), ColumnParallelLinear, **where)
        shard_linear_(getattr(module, row), RowParallelLinear, **where)

    def _check_divides(self, name: str, what: str, count: int) -> None:
        size = self.mesh.mp_size
        if count % size:
            raise ValueError(
                f"tensor parallel size {size} does not divide {what}={count} of {name}: "
                f"use a tensor-parallel size that divides {count}"
            )
