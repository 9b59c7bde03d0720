"""Row gathers for token dispatch whose backward is a gather or an index_add too.

Autograd's backward of ``x[index]`` zero-fills a tensor the size of ``x`` and scatters into it
with an accumulating ``index_put_``, the slowest way to move rows on CPU. A permutation's
backward is the inverse permutation (one gather), and a gather with repeated rows needs one
``index_add_``.
"""

from __future__ import annotations

import torch


class _PermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, perm, inverse):
        ctx.save_for_backward(inverse)
        return rows.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, index):
        ctx.save_for_backward(index)
        ctx.num_rows = rows.shape[0]
        return rows.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        out = grad.new_zeros((ctx.num_rows, *grad.shape[1:]))
        return out.index_add_(0, index, grad), None


def permute_rows(rows: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``rows[perm]`` for a permutation ``perm`` whose inverse is ``inverse``."""
    return _PermuteRows.apply(rows, perm, inverse)


def gather_rows(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``rows[index]`` (rows may repeat); backward adds the gradients of repeated rows."""
    return _GatherRows.apply(rows, index)


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """The permutation undoing ``perm``."""
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    return inverse
