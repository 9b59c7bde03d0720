"""Differentiable collectives for model-parallel compute.

Each function is an identity when ``group`` is None (size-1 parallelism, single process).

[Note: collective order in backward]
A collective in backward must run on every rank of its group, in the same order. The modules
here call them unconditionally (a rank that sends or receives no rows still takes part with an
empty tensor) and build the same graph on every rank, so autograd reaches them in the same order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from tierwise.parallel.collectives import Collectives

_COLLECTIVES = Collectives()
"""Activations are on the compute device; on NCCL that is the current CUDA device, which the
layer uses ([Note: collectives on the group's device])."""


class _AllToAll(torch.autograd.Function):
    """Rows to ranks: forward sends ``in_splits[r]`` rows to rank r; backward sends them back."""

    @staticmethod
    def forward(ctx, rows, out_splits, in_splits, group):
        ctx.splits = (out_splits, in_splits)
        ctx.group = group
        return _all_to_all(rows, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad_out):
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad_out, in_splits, out_splits, ctx.group), None, None, None


def _all_to_all(rows, out_splits, in_splits, group):
    out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
    _COLLECTIVES.all_to_all(out, rows, out_splits, in_splits, group)
    return out


def all_to_all(
    rows: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """Send ``in_splits[r]`` consecutive rows to rank r of ``group``; receive ``out_splits[r]``
    rows from rank r. Backward runs the reverse exchange."""
    if group is None:
        return rows
    return _AllToAll.apply(rows, list(out_splits), list(in_splits), group)


def exchange_counts(counts: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Equal-split all-to-all of an integer tensor (no gradient): block r goes to rank r."""
    if group is None:
        return counts
    out = torch.empty_like(counts)
    _COLLECTIVES.all_to_all(out, counts, None, None, group)
    return out


class _CopyToGroup(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce (sum) of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        _COLLECTIVES.all_reduce(grad, ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    """Megatron's g: all-reduce (sum) forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        _COLLECTIVES.all_reduce(out, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_group(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Input of a column-parallel layer: every rank uses all of ``x``; gradients are summed."""
    return x if group is None else _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Output of a row-parallel layer: partial sums of all ranks are added."""
    return x if group is None else _ReduceFromGroup.apply(x, group)
