"""Plain data parallelism: every parameter, sharded over the whole world (ZeRO through rCache)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tierwise.parallel.base import ParallelPattern

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist


class DataParallel(ParallelPattern):
    """Claims every parameter; its data-parallel group is the run's world."""

    PLUGIN_NAME = "data"

    def claims(self, name: str, param: torch.nn.Parameter) -> bool:
        return True

    def dp_group(self) -> dist.ProcessGroup | None:
        return self.process_group
