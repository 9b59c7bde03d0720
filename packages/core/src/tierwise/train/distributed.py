"""torchrun support: a process group from the environment, rank 0 prints and writes."""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from tierwise.parallel.collectives import Collectives
from tierwise.parallel.timeouts import collective_timeout


@dataclass(frozen=True, kw_only=True)
class World:
    """Where this process stands in the run."""

    rank: int
    """This process's rank (0 when not under torchrun)."""
    size: int
    """Number of processes."""
    device: str
    """The compute device of this rank (cuda:LOCAL_RANK under torchrun on CUDA)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def collectives(self) -> Collectives:
        """Collectives over the world on its backend's device ([Note: collectives on the
        group's device])."""
        return Collectives(self.device)


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_world(device: str) -> World:
    """Join the torchrun process group (nccl on CUDA, gloo otherwise) when launched by torchrun."""
    if not launched_by_torchrun():
        return World(rank=0, size=1, device=device)
    if torch.device(device).type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if device.startswith("cuda") else "gloo", timeout=collective_timeout()
        )  # [Note: bounded collectives]
    return World(rank=dist.get_rank(), size=dist.get_world_size(), device=device)


def barrier(world: World) -> None:
    if world.size > 1:
        world.collectives.barrier()


def mean_over_ranks(value: float, world: World) -> float:
    """The mean of ``value`` over all ranks (the value itself on one rank)."""
    if world.size == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.float64)
    world.collectives.all_reduce(tensor, None)
    return float(tensor.item()) / world.size


def same_on_all_ranks(run_dir: Path, world: World) -> Path:
    """Rank 0's run directory name (a default name holds the time, which ranks may disagree on)."""
    if world.size == 1:
        return run_dir
    return Path(world.collectives.broadcast_object(str(run_dir)))


def close_world(world: World) -> None:
    """Destroy the process groups while the interpreter is fully alive.

    [Note: destroying process groups]
    A gloo worker thread can drop the last reference to a tensor of a finished collective
    slightly after the collective returned; when that tensor's Python object is gone by then,
    dropping it takes the GIL, and a thread doing that while the interpreter shuts down aborts
    the process ("terminate called without an active exception", a PyTorch bug). Destroying a
    process group joins its worker threads, but only once nothing else holds the group: the
    model and its engine (which form reference cycles) are collected first, so that
    ``destroy_process_group`` really destroys the groups now rather than at interpreter exit.
    """
    if world.size > 1 and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
