"""Stand-ins for ops whose fake (meta) kernel is stricter than their real CPU kernel.

``aten._grouped_mm`` (MoE experts in transformers) has a meta kernel that accepts bf16 only, as
the CUDA kernel does, while the CPU kernel also runs fp32/fp16. The stand-in computes the output
shape in bf16 and returns a tensor of the caller's dtype: same shape, same bytes as the real op.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def _grouped_mm_any_dtype(func, args, kwargs):
    mat_a, mat_b, *rest = args
    if mat_a.dtype == torch.bfloat16 and mat_b.dtype == torch.bfloat16:
        return func(*args, **kwargs)
    out_dtype = kwargs.pop("out_dtype", None) or mat_a.dtype
    out = func(mat_a.to(torch.bfloat16), mat_b.to(torch.bfloat16), *rest, **kwargs)
    return out.to(out_dtype)


FIXES = {aten._grouped_mm: _grouped_mm_any_dtype}
"""Op packet -> ``fix(func, args, kwargs)`` that runs it under fake tensors."""


def run_op(func, args, kwargs):
    """``func(*args, **kwargs)``, through a stand-in where one is needed."""
    fix = FIXES.get(func.overloadpacket)
    if fix is None:
        return func(*args, **kwargs)
    return fix(func, args, dict(kwargs))
