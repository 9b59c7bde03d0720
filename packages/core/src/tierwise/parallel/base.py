"""The ParallelPattern interface (Elixir journal version: a pattern per parameter).

A pattern claims parameters, tells the engine over which data-parallel group their chunks are
sharded, and may rewrite modules so they compute across its model-parallel group. Core groups
chunks by (pattern key, param group, requires_grad), so each pattern's parameters chunk and shard
on their own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from tierwise.config import Config


class ParallelPattern(ABC):
    """Subclasses set ``PLUGIN_NAME`` ("data", "expert", "tensor", ...)."""

    PLUGIN_NAME: ClassVar[str]

    def __init__(self, *, size: int, config: Config, process_group: dist.ProcessGroup | None):
        self.size = size
        """Model-parallel size (1 for plain data parallel)."""
        self.config = config
        self.process_group = process_group
        """The world this run spans (None: single process)."""

    @property
    def key(self) -> str:
        """Chunk-group key for parameters this pattern claims."""
        return self.PLUGIN_NAME

    def prepare(self, model: torch.nn.Module) -> None:  # noqa: B027 - optional hook
        """Rewrite modules in place for model-parallel compute (default: nothing)."""

    @abstractmethod
    def claims(self, name: str, param: torch.nn.Parameter) -> bool:
        """Whether this pattern owns ``param`` (first claiming pattern wins; "data" claims all)."""

    @abstractmethod
    def dp_group(self) -> dist.ProcessGroup | None:
        """Group over which the claimed parameters' chunks are sharded (None: no sharding)."""
