"""FLOPs of one aten op from shapes alone (2·M·N·K per matrix product).

torch's own formulas (``torch.utils.flop_counter``: mm, addmm, bmm, baddbmm, convolution, the
CUDA attention kernels) plus the two this profiler meets that torch does not count: grouped
matmuls (MoE experts) and the CPU flash-attention kernel.
"""

from __future__ import annotations

import math

import torch
from torch.utils.flop_counter import flop_registry

aten = torch.ops.aten


def _grouped_mm_flops(mat_a, mat_b, *args, out_val=None, **kwargs) -> int:
    # every output row is one (token, expert) product: 2 · rows · K · N in all
    k = mat_a.shape[-1]
    return 2 * math.prod(out_val.shape) * k


def _cpu_flash_attention_flops(query, key, value, *args, **kwargs) -> int:
    # scores = Q·Kᵀ, then probabilities·V
    *batch, q_len, head_dim = query.shape
    kv_len = key.shape[-2]
    value_dim = value.shape[-1]
    heads = math.prod(batch)
    return 2 * heads * q_len * kv_len * (head_dim + value_dim)


_EXTRA = {
    aten._grouped_mm: _grouped_mm_flops,
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_attention_flops,
}


def op_flops(func, args, kwargs, out) -> int:
    """FLOPs of ``func(*args, **kwargs) -> out``; 0 for ops that are not matrix products."""
    packet = func.overloadpacket
    formula = _EXTRA.get(packet)
    if formula is not None:
        return int(formula(*args, out_val=out, **kwargs))
    formula = flop_registry.get(packet)
    if formula is None:
        return 0
    return int(formula(*args, out_val=out, **kwargs))


def counts_flops(func) -> bool:
    """Whether :func:`op_flops` can be non-zero for ``func`` (cheap pre-check)."""
    packet = func.overloadpacket
    return packet in _EXTRA or packet in flop_registry
