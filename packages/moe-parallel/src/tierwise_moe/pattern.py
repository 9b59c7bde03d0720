"""What expert and tensor parallelism share: a mesh of groups and claiming by recorded name."""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch

from tierwise.parallel import ParallelPattern
from tierwise_moe.mesh import Mesh, build_mesh

if TYPE_CHECKING:
    import torch.distributed as dist

    from tierwise.config import Config


class ModelParallelPattern(ParallelPattern):
    """A pattern that replaces modules by sharded ones in ``prepare`` and claims their parameters.

    Creating it creates its process groups (collective: every rank constructs the same patterns
    in the same order).
    """

    SHARDED_TYPES: ClassVar[tuple[type[torch.nn.Module], ...]]
    """Module classes whose parameters this pattern claims."""

    def __init__(self, *, size: int, config: Config, process_group: dist.ProcessGroup | None):
        super().__init__(size=size, config=config, process_group=process_group)
        self.mesh: Mesh = build_mesh(process_group, size, what=f"{self.PLUGIN_NAME} parallel")
        self._claimed: set[str] | None = None  # full parameter names, known after prepare()

    def prepare(self, model: torch.nn.Module) -> None:
        self._shard_modules(model)
        self._claimed = {
            f"{module_name}.{attr}" if module_name else attr
            for module_name, module in model.named_modules()
            if self._is_own_module(module)
            for attr, _ in module.named_parameters(recurse=False)
        }

    def claims(self, name: str, param: torch.nn.Parameter) -> bool:
        if self._claimed is None:
            raise RuntimeError(f"{type(self).__name__}.claims() before prepare(model)")
        return name in self._claimed

    def dp_group(self) -> dist.ProcessGroup | None:
        """The ranks holding the same shards (the complement of the model-parallel group)."""
        return self.mesh.dp_group

    @abstractmethod
    def _shard_modules(self, model: torch.nn.Module) -> None:
        """Replace the modules this pattern splits (idempotent)."""

    def _is_own_module(self, module: torch.nn.Module) -> bool:
        """Whether ``module`` is one of the sharded modules this pattern creates."""
        return isinstance(module, self.SHARDED_TYPES)


def replace_module(model: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    """Put ``new`` where the submodule called ``name`` is."""
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)
