"""Setup stage 1, patterns: the parallel patterns ``Config.parallel`` names (and the data
pattern), each with its data-parallel group; model-parallel patterns shard the model's modules
before anything is sized."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tierwise.config import Config, ConfigError
from tierwise.parallel import ParallelPattern
from tierwise.plugins import PluginHost


@dataclass(frozen=True, kw_only=True)
class Patterns:
    """The parallel patterns of one setup."""

    patterns: list[ParallelPattern]
    """In claiming order: ``Config.parallel``'s, then the data pattern (claims the rest)."""
    world_rank: dict[str, tuple[Any, int, int]]
    """Pattern key -> (process group, world size, rank) of its data-parallel group."""

    def dp_size(self, pattern: ParallelPattern) -> int:
        """The size of ``pattern``'s data-parallel group."""
        return self.world_rank[pattern.key][1]


def world_group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The group setup runs over: ``process_group``, else the default one when initialised."""
    if process_group is not None:
        return process_group
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def make_patterns(config: Config, host: PluginHost, world) -> list[ParallelPattern]:
    """The patterns ``Config.parallel`` names, then the data pattern; nothing changes yet."""
    classes = host.pattern_classes()
    patterns = []
    for name, size in (config.parallel or {}).items():
        if name not in classes:
            raise ConfigError(
                f"Config.parallel names pattern {name!r}, which no installed plugin provides; "
                f"available: {', '.join(sorted(classes))} (tierwise-moe adds 'expert' and 'tensor')"
            )
        patterns.append(classes[name](size=size, config=config, process_group=world))
    patterns.append(classes["data"](size=1, config=config, process_group=world))
    return patterns


def prepare_model(model: torch.nn.Module, patterns: list[ParallelPattern]) -> Patterns:
    """Let every pattern prepare ``model`` (model-parallel ones shard modules: the caller keeps
    a snapshot, [Note: atomic setup]); return them with their data-parallel groups."""
    for pattern in patterns:
        pattern.prepare(model)
    return Patterns(patterns=patterns, world_rank={p.key: _dp_world(p) for p in patterns})


def _dp_world(pattern: ParallelPattern) -> tuple[Any, int, int]:
    pg = pattern.dp_group()
    if pg is None or not dist.is_initialized():
        return None, 1, 0
    return pg, dist.get_world_size(pg), dist.get_rank(pg)
