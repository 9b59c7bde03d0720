"""The "tensor" pattern: Megatron column/row-parallel linears for Llama-style attention and MLP.

Attention: q/k/v are column-parallel (each rank computes its share of the heads; the attention
itself runs on local heads unchanged), o is row-parallel. MLP: gate/up column-parallel, down
row-parallel. One all-reduce in forward per block (after the row-parallel linear) and one per
column-parallel input in backward. Ranks of a tensor-parallel group must get the same batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tierwise_moe.collectives import copy_to_group, reduce_from_group
from tierwise_moe.pattern import ModelParallelPattern, replace_module
from tierwise_moe.shards import SPECS_ATTR, ShardSpec

ATTENTION_PROJS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJS = ("gate_proj", "up_proj", "down_proj")


class _ShardedLinear(torch.nn.Module):
    """A block of an nn.Linear (``weight`` and ``bias`` keep their names)."""

    def __init__(self, linear: torch.nn.Linear, weight_spec: ShardSpec, bias_spec: ShardSpec | None):
        super().__init__()
        self.group = weight_spec.group
        self.weight = torch.nn.Parameter(
            weight_spec.shard(linear.weight.detach()).clone(),
            requires_grad=linear.weight.requires_grad,
        )
        specs = {"weight": weight_spec}
        if linear.bias is None:
            self.bias = None
        else:
            bias = linear.bias.detach()
            self.bias = torch.nn.Parameter(
                (bias if bias_spec is None else bias_spec.shard(bias)).clone(),
                requires_grad=linear.bias.requires_grad,
            )
            if bias_spec is not None:
                specs["bias"] = bias_spec
        setattr(self, SPECS_ATTR, specs)

    def extra_repr(self) -> str:
        spec = getattr(self, SPECS_ATTR)["weight"]
        return f"weight={tuple(self.weight.shape)}, shard {spec.rank} of {spec.size} along dim {spec.dim}"


class ColumnParallelLinear(_ShardedLinear):
    """Output features split: rank r computes features [r*out/P, (r+1)*out/P) from all of x."""

    def __init__(self, linear: torch.nn.Linear, *, rank: int, size: int, group):
        spec = ShardSpec(dim=0, rank=rank, size=size, group=group)
        super().__init__(linear, spec, spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_group(x, self.group), self.weight, self.bias)


class RowParallelLinear(_ShardedLinear):
    """Input features split: rank r multiplies its slice of x; partial sums are all-reduced.
    The bias is whole on every rank and added once, after the reduction."""

    def __init__(self, linear: torch.nn.Linear, *, rank: int, size: int, group):
        super().__init__(linear, ShardSpec(dim=1, rank=rank, size=size, group=group), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = reduce_from_group(F.linear(x, self.weight), self.group)
        return out if self.bias is None else out + self.bias


def _has_linears(module: torch.nn.Module, names: tuple[str, ...]) -> bool:
    return all(
        isinstance(getattr(module, name, None), (torch.nn.Linear, _ShardedLinear)) for name in names
    )


class TensorParallel(ModelParallelPattern):
    """Tensor parallelism (Megatron) for Llama-style attention and gated MLPs.

    Every module with ``q_proj, k_proj, v_proj, o_proj`` linears and a ``head_dim`` (attention)
    or ``gate_proj, up_proj, down_proj`` linears (MLP) is split over the P consecutive ranks of
    a tensor-parallel group. Embeddings, norms and the LM head stay data-parallel. The ranks of a
    tensor-parallel group must be fed the same batch; :meth:`dp_group` (ranks holding the same
    shard) is where the batch differs.
    """

    PLUGIN_NAME = "tensor"
    SHARDED_TYPES = (ColumnParallelLinear, RowParallelLinear)

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
            if not isinstance(module.q_proj, _ShardedLinear):  # prepare() is idempotent
                head_dim = module.head_dim
                self._check_divides(name, "num_attention_heads", module.q_proj.out_features // head_dim)
                self._check_divides(name, "num_key_value_heads", module.k_proj.out_features // head_dim)
                self._split(model, name, module, column=("q_proj", "k_proj", "v_proj"), row="o_proj")
        for name, module in mlps:
            if not isinstance(module.gate_proj, _ShardedLinear):
                self._check_divides(name, "intermediate size", module.gate_proj.out_features)
                self._split(model, name, module, column=("gate_proj", "up_proj"), row="down_proj")

    def _split(self, model, name, module, *, column: tuple[str, ...], row: str) -> None:
        mesh = self.mesh
        where = dict(rank=mesh.mp_rank, size=mesh.mp_size, group=mesh.mp_group)
        for attr in column:
            replace_module(model, f"{name}.{attr}", ColumnParallelLinear(getattr(module, attr), **where))
        replace_module(model, f"{name}.{row}", RowParallelLinear(getattr(module, row), **where))

    def _check_divides(self, name: str, what: str, count: int) -> None:
        size = self.mesh.mp_size
        if count % size:
            raise ValueError(
                f"tensor parallel size {size} does not divide {what}={count} of {name}: "
                f"use a tensor-parallel size that divides {count}"
            )
