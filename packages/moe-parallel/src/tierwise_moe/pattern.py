"""What expert and tensor parallelism share: a mesh of groups, in-place sharding, claiming by tag."""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING

import torch
from tierwise.parallel import ParallelPattern

from tierwise_moe.mesh import Mesh, build_mesh
from tierwise_moe.shards import spec_of

if TYPE_CHECKING:
    import torch.distributed as dist
    from tierwise.config import Config


class ModelParallelPattern(ParallelPattern):
    """A pattern that shards modules in place in ``prepare`` (see [Note: sharding in place])
    and claims the parameters it sharded.

    Creating it creates its process groups (collective: every rank constructs the same patterns
    in the same order).
    """

    def __init__(self, *, size: int, config: Config, process_group: dist.ProcessGroup | None):
        super().__init__(size=size, config=config, process_group=process_group)
        self.mesh: Mesh = build_mesh(
            process_group, size, what=f"{self.PLUGIN_NAME} parallel", inner=self._inner_size()
        )
        self._prepared = False

    def _inner_size(self) -> int:
        """Size of a model parallelism nested inside this one (see ``build_mesh``); 1: none."""
        return 1

    def prepare(self, model: torch.nn.Module) -> None:
        """Shard this pattern's modules of ``model`` in place (idempotent)."""
        self._shard_modules(model)
        self._prepared = True

    def claims(self, name: str, param: torch.nn.Parameter) -> bool:
        if not self._prepared:
            raise RuntimeError(
                f"{type(self).__name__}.claims({name!r}) before prepare(model): parameters "
                "are only known to be sharded after prepare; call prepare(model) first"
            )
        spec = spec_of(param)
        return spec is not None and spec.pattern == self.PLUGIN_NAME

    def dp_group(self) -> dist.ProcessGroup | None:
        """The ranks holding the same shards (the complement of the model-parallel group)."""
        return self.mesh.dp_group

    def full_tensor(
        self, name: str, param: torch.nn.Parameter, local: torch.Tensor
    ) -> torch.Tensor:
        """All-gather this rank's block of ``param`` over the model-parallel group (collective)."""
        return self._spec(name, param).gather(local)

    def local_tensor(
        self, name: str, param: torch.nn.Parameter, full: torch.Tensor
    ) -> torch.Tensor:
        """This rank's block of the whole-model value ``full`` (no communication)."""
        return self._spec(name, param).shard(full)

    def local_slice(self, name: str, param: torch.nn.Parameter) -> tuple[int, int, int, int]:
        """This rank's block along the split dimension (read alone by a weight source)."""
        spec = self._spec(name, param)
        size = param.shape[spec.dim]
        return spec.dim, spec.rank * size, (spec.rank + 1) * size, size * spec.size

    def _spec(self, name: str, param: torch.nn.Parameter):
        spec = spec_of(param)
        if spec is None or spec.pattern != self.PLUGIN_NAME:
            raise ValueError(f"{name} is not a parameter the {self.PLUGIN_NAME!r} pattern sharded")
        return spec

    @abstractmethod
    def _shard_modules(self, model: torch.nn.Module) -> None:
        """Shard the modules this pattern splits, skipping those already sharded."""
