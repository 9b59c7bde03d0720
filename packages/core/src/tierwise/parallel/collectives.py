"""torch.distributed collectives that count the bytes they move (engine.stats()["comm_bytes"])."""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist


class Collectives:
    """Thin wrapper: each call does one torch.distributed collective and counts its payload.

    Bytes are counted as the size of the full (gathered / pre-reduction) chunk per call, the
    convention of Elixir's Table 1.
    """

    def __init__(self) -> None:
        self.bytes: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()

    def _count(self, name: str, tensor: torch.Tensor) -> None:
        self.bytes[name] += tensor.numel() * tensor.element_size()
        self.calls[name] += 1

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, group) -> None:
        self._count("all_gather", out)
        dist.all_gather_into_tensor(out, shard, group=group)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, group) -> None:
        self._count("reduce_scatter", full)
        dist.reduce_scatter_tensor(out, full, op=dist.ReduceOp.SUM, group=group)

    def all_reduce(self, tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> None:
        self._count("all_reduce", tensor)
        dist.all_reduce(tensor, op=op, group=group)
