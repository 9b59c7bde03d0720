"""Rank layout of one model-parallel pattern: model-parallel groups and their complement.

The world's ranks (in the order of the run's process group) are cut into consecutive blocks of
``size`` ranks: one block is a model-parallel group (the ranks that split one layer between them).
The complement, the ranks with the same position in every block, hold the same shard and form the
data-parallel group of the sharded parameters. For 4 ranks and size 2: model-parallel groups
{0,1} and {2,3}; data-parallel groups {0,2} and {1,3}.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from tierwise.parallel.timeouts import collective_timeout


class MeshError(ValueError):
    """The requested model-parallel size does not fit the run's world."""


@dataclass(frozen=True, kw_only=True)
class Mesh:
    """This rank's model-parallel and data-parallel groups for one pattern."""

    mp_group: dist.ProcessGroup | None
    """Ranks that split one layer between them (None: size 1, nothing is split)."""
    mp_rank: int
    """This rank's position in ``mp_group``: which shard it holds."""
    mp_size: int
    """Number of shards (the pattern's size)."""
    dp_group: dist.ProcessGroup | None
    """Ranks holding the same shard (None: single process)."""
    dp_size: int
    """Number of ranks in ``dp_group``."""

    def __post_init__(self) -> None:
        if not 0 <= self.mp_rank < self.mp_size:
            raise MeshError(f"mp_rank {self.mp_rank} outside a group of size {self.mp_size}")


def build_mesh(
    process_group: dist.ProcessGroup | None, size: int, *, what: str, inner: int = 1
) -> Mesh:
    """Create the groups for ``size``-way model parallelism over ``process_group``.

    ``inner`` is the size of a model parallelism nested inside this one (tensor parallelism
    inside expert parallelism): its groups are ``inner`` consecutive ranks, and this pattern's
    groups take one rank of each, so that the two split different ranks. World 4, size 2,
    inner 2: model-parallel groups {0,2} and {1,3}; data-parallel groups {0,1} and {2,3}.

    Collective: every rank of ``process_group`` must call it, in the same order relative to
    other group creations (``dist.new_group`` requires it).
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise MeshError(f"{what} size {size!r}: give a positive integer")
    if process_group is None:
        if size != 1:
            raise MeshError(
                f"{what} size {size} needs a distributed run with a world divisible by {size}; "
                "this run is a single process: start it with torchrun (or init_process_group) "
                f"on a multiple of {size} ranks, or use size 1"
            )
        return Mesh(mp_group=None, mp_rank=0, mp_size=1, dp_group=None, dp_size=1)
    ranks = dist.get_process_group_ranks(process_group)
    world = len(ranks)
    block = size * inner
    if world % block:
        nested = f" times the nested model-parallel size {inner}" if inner > 1 else ""
        raise MeshError(
            f"{what} size {size}{nested} does not divide the world of {world} ranks: "
            f"use sizes whose product divides {world}, or run on a multiple of {block} ranks"
        )
    me = dist.get_rank()
    mp_group = dp_group = None
    for start in range(0, world, block):
        for offset in range(inner):
            members = ranks[start + offset : start + block : inner]
            group = dist.new_group(members, timeout=collective_timeout())
            if me in members:
                mp_group, mp_rank = group, members.index(me)
    for position in range(size):  # ranks holding the same shard
        members = [ranks[i] for i in range(world) if (i // inner) % size == position]
        group = dist.new_group(members, timeout=collective_timeout())
        if me in members:
            dp_group = group
    return Mesh(
        mp_group=mp_group if size > 1 else None,
        mp_rank=mp_rank,
        mp_size=size,
        dp_group=dp_group,
        dp_size=world // size,
    )
