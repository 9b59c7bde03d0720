"""torch.distributed collectives that count the bytes they move (engine.stats()["comm_bytes"])."""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

# torch 2.13 renamed the tensor collectives; keep torch>=2.4 working with the old names
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""``all_gather_into(out, shard, group=..., async_op=...)``: uncounted tensor all-gather."""
reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""``reduce_scatter_into(out, full, op=..., group=..., async_op=...)``: uncounted."""


class Collectives:
    """Thin wrapper: each call does one torch.distributed collective and counts its payload.

    Bytes are counted as the size of the full (gathered / pre-reduction) chunk per call, and
    twice that for all-reduce: the convention of Elixir's Table 1.
    """

    def __init__(self) -> None:
        self.bytes: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()

    def _count(self, name: str, tensor: torch.Tensor) -> None:
        self.bytes[name] += tensor.numel() * tensor.element_size()
        self.calls[name] += 1

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, group, async_op: bool = False):
        self._count("all_gather", out)
        return all_gather_into(out, shard, group=group, async_op=async_op)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, group, async_op: bool = False):
        self._count("reduce_scatter", full)
        return reduce_scatter_into(out, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op)

    def all_reduce(self, tensor: torch.Tensor, group, op=dist.ReduceOp.SUM, async_op: bool = False):
        # a ring all-reduce moves the payload twice (reduce-scatter + all-gather): Table 1
        self._count("all_reduce", tensor)
        self.bytes["all_reduce"] += tensor.numel() * tensor.element_size()
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
