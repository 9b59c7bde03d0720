"""The ParallelPattern interface (Elixir journal version: a pattern per parameter).

A pattern claims parameters, tells the engine over which data-parallel group their chunks are
sharded, and may rewrite modules so they compute across its model-parallel group. Core groups
chunks by (pattern key, param group, requires_grad), so each pattern's parameters chunk and shard
on their own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
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

    def full_tensor(
        self, name: str, param: torch.nn.Parameter, local: torch.Tensor
    ) -> torch.Tensor:
        """The whole model's value of ``param`` (as the unprepared model had it) from this rank's
        ``local`` value (already complete over the data-parallel group; may be returned as is).

        Collective over the model-parallel group: ``model.state_dict()`` calls it on every rank,
        for the same parameters in the same order. Default: ``local`` (nothing is split).
        """
        return local

    def local_tensor(
        self, name: str, param: torch.nn.Parameter, full: torch.Tensor
    ) -> torch.Tensor:
        """This rank's part of ``full``, a whole-model value of ``param`` (inverse of
        :meth:`full_tensor`; no communication). Default: ``full``."""
        return full

    def local_slice(self, name: str, param: torch.nn.Parameter) -> tuple[int, int, int, int] | None:
        """This rank's block of ``param`` as ``(dim, start, stop, size)``: elements
        ``start:stop`` along dimension ``dim`` of the whole-model tensor, whose size along it is
        ``size``; a weight source reads only that part (``tierwise.weights``). None: all of it.
        Default: None (nothing is split)."""
        return None

    @abstractmethod
    def claims(self, name: str, param: torch.nn.Parameter) -> bool:
        """Whether this pattern owns ``param`` (first claiming pattern wins; "data" claims all)."""

    @abstractmethod
    def dp_group(self) -> dist.ProcessGroup | None:
        """Group over which the claimed parameters' chunks are sharded (None: no sharding)."""


# [Note: atomic setup]
# ``prepare`` changes the model (slices parameters, swaps module classes), but what it changes
# decides the later steps of setup (profile, plan, chunk layout, allocation), any of which may
# still fail on bad input. setup therefore snapshots the model before the first ``prepare`` and
# restores it when a later step raises, so that a failed setup leaves the model as it was,
# whatever the pattern did. The snapshot holds references, not copies: each parameter's
# original ``.data`` stays alive until setup returns (for a model built on cpu, the full
# model-parallel parameters stay in memory during setup, as they were before it).
def snapshot_model(model: torch.nn.Module) -> Callable[[], None]:
    """Remember every module's class, attributes and child/parameter/buffer tables, and every
    parameter's data and attributes; return a function that puts them back."""
    registries = ("_parameters", "_buffers", "_modules")
    modules = [
        (m, type(m), {k: dict(v) if k in registries else v for k, v in vars(m).items()})
        for m in model.modules()
    ]
    params = [(p, p.data, dict(vars(p))) for p in model.parameters()]

    def restore() -> None:
        for module, cls, attrs in modules:
            module.__class__ = cls
            vars(module).clear()
            vars(module).update(attrs)
        for param, data, attrs in params:
            param.data = data
            vars(param).clear()
            vars(param).update(attrs)

    return restore
