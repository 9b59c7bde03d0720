"""The step's checks over every chunk's gradients: the total norm, fp16 overflow, which
parameters got a gradient on any rank, and the factors applied to gradients before the update.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from tierwise.chunks import Chunk
from tierwise.devices import stack_on
from tierwise.parallel.collectives import Collectives, world_size
from tierwise.runtime.grads.storage import ChunkGrads
from tierwise.runtime.index import ChunkIndex


def _first(pair: tuple) -> int:
    return pair[0]


def grad_multiplier(unscale: list | None, clip_coef: torch.Tensor | None) -> list | None:
    """Factors applied to fp32 gradients before the update: 1/loss scale (fp16: ``unscale``),
    then the clip coefficient — in that order, as GradScaler.unscale_ + clip_grad_norm_ do.

    [Note: host scalars]
    The factors are 0-dim CPU tensors, made once per step. A 0-dim CPU tensor multiplies a
    tensor on any device as a kernel argument: no copy to the device, no wait, where moving
    it to the device for each chunk would queue a blocking host-to-device copy per chunk.
    The other way round, what the step reads of the gradients (the norm, fp16 overflow) is
    accumulated where the gradients are and read on the host once per step: a chunk's norm
    part and finite flag stay on its device, no per-chunk ``.cpu()``, ``bool()`` or fp64 copy
    of a shard. The clip coefficient is computed on the host from that one read, so it is a
    host scalar too."""
    factors = unscale or []
    if clip_coef is not None:
        factors.append(clip_coef)
    return factors or None


class GradChecks:
    """Norm, overflow and gradient agreement over the chunks and ranks."""

    def __init__(
        self,
        *,
        index: ChunkIndex,
        collectives: Collectives,
        world_group: dist.ProcessGroup | None,
        param_order: dict[int, int],
        device: torch.device,
    ) -> None:
        self.index = index
        self.collectives = collectives
        self.world_group = world_group
        self.multi_rank = index.multi_rank
        self.param_order = param_order
        """id(param) -> its position in ``model.parameters()`` (the order of norms)."""
        self.device = device

    def norm_parts(self, chunk: Chunk, grads: ChunkGrads):
        """One chunk's part of the total norm: (position, norm) per parameter with a gradient
        (one process), or its sum of squares (several ranks, replicated chunks counted once)."""
        if not self.multi_rank:
            return [
                (
                    self.param_order[id(s.param)],
                    torch.linalg.vector_norm(grads.slot(s), 2.0, dtype=torch.float32),
                )
                for s in chunk.slots
                if s.has_grad  # clip_grad_norm_ skips parameters whose grad is None
            ]
        # the shard's norm accumulated in fp64 by the reduction itself (no fp64 copy of the
        # shard), squared; on the shard's device, read once per step ([Note: host scalars]).
        # fp64, not fp32: the parts of differently chunked plans must sum to the same float
        # (Invariant 1)
        sq = torch.linalg.vector_norm(grads.shard, 2.0, dtype=torch.float64).square()
        return sq if chunk.group.sharded else sq / chunk.group.world

    def all_reduce_scalar(self, value: torch.Tensor, op) -> torch.Tensor:
        """``value`` reduced over the ranks, where it was ([Note: collectives on the group's
        device] puts it on the group's device for the collective)."""
        if world_size(self.world_group) > 1:
            self.collectives.all_reduce(value, self.world_group, op=op)
        return value

    def total_norm(self, parts: Iterable) -> torch.Tensor:
        """2-norm of all gradients as stored (still loss-scaled in fp16), from every filled
        chunk's ``norm_parts`` in chunk order.

        One process: per-parameter norms, then the norm of those, exactly as
        ``torch.nn.utils.clip_grad_norm_`` computes it over the fp32 gradients a mixed-precision
        loop hands its fp32 masters (a bf16/fp16 norm would round the clip coefficient to a few
        bits, and overflow under fp16 loss scaling). Several ranks: sums of squares of each
        rank's shards (replicated chunks counted once), all-reduced.
        """
        if not self.multi_rank:  # in model.parameters() order, whatever the chunk layout
            norms = sorted((pair for chunk_pairs in parts for pair in chunk_pairs), key=_first)
            if not norms:
                return torch.zeros((), dtype=torch.float32)
            # per-parameter norms live on their gradient's device: gathered on the compute device
            # as torch.nn.utils.clip_grad_norm_ gathers them on the first gradient's
            stacked = stack_on([n for _, n in norms], self.device)
            return torch.linalg.vector_norm(stacked, 2.0).float().cpu()
        squares = list(parts)  # in chunk order, recorded or not; on their devices
        if squares:
            total = stack_on(squares, self.device).sum()
        else:
            total = torch.zeros((), dtype=torch.float64, device=self.device)
        # summed on the device, reduced there ([Note: collectives on the group's device]),
        # read on the host once: [Note: host scalars]
        return self.all_reduce_scalar(total, dist.ReduceOp.SUM).sqrt().float().cpu()

    def found_overflow(self, finite: Iterable[torch.Tensor]) -> bool:
        """Whether a gradient on any rank is not finite (``finite``: a 0-dim flag per filled
        chunk, on its gradients' device): combined on the device, one host read per step
        ([Note: host scalars])."""
        flags = list(finite)
        if flags:
            flag = (~stack_on(flags, self.device).all()).float()
        else:
            flag = torch.zeros((), dtype=torch.float32, device=self.device)
        return bool(self.all_reduce_scalar(flag, dist.ReduceOp.MAX) > 0)

    def agree_on_grads(self) -> None:
        """Several ranks: a parameter has a gradient when it got one on any rank of its chunk's
        data-parallel group (DDP reduces it to every rank): [Note: unused parameters are
        skipped]. One small all-reduce per process group of the trainable groups, in group
        order. When every slot here has a gradient the result is known (all of them, the
        maximum over ranks): the flags are made on the device and nothing is read back; else
        they go up once and come back once ([Note: host scalars])."""
        by_group: dict = {}
        for group in self.index.groups:
            if group.trainable and group.world > 1:
                slots = [slot for chunk in group.chunks for slot in chunk.slots]
                by_group.setdefault(group.process_group, []).extend(slots)
        for process_group, slots in by_group.items():
            if all(slot.has_grad for slot in slots):
                flags = self.collectives.filled(len(slots), 1.0, torch.float32, process_group)
                self.collectives.all_reduce(flags, process_group, op=dist.ReduceOp.MAX)
                continue
            flags = torch.tensor([slot.has_grad for slot in slots], dtype=torch.float32)
            self.collectives.all_reduce(flags, process_group, op=dist.ReduceOp.MAX)
            for slot, flag in zip(slots, flags.tolist(), strict=True):
                slot.has_grad = flag > 0
