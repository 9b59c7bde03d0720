"""tierwise-moe: expert-parallel and tensor-parallel patterns for fine-grained plans.

Registered through ``tierwise_register_parallel_patterns`` as "expert" and "tensor"; used by
``tierwise.setup(model, optimizer, parallel={"expert": 2})``. Importing this module stays light
(the entry point is loaded whenever tierwise builds its plugin host): the patterns and their
torch code load on first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from tierwise.hookspecs import hookimpl

from tierwise_moe._version import __version__
from tierwise_moe.settings import MoESettings

_LAZY = {
    "ExpertParallel": "tierwise_moe.expert_parallel",
    "TensorParallel": "tierwise_moe.tensor_parallel",
    "ShardedExperts": "tierwise_moe.experts",
    "ColumnParallelLinear": "tierwise_moe.tensor_parallel",
    "RowParallelLinear": "tierwise_moe.tensor_parallel",
    "full_state_dict": "tierwise_moe.shards",
    "load_full_state_dict": "tierwise_moe.shards",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tierwise_moe' has no attribute {name!r}")


@hookimpl
def tierwise_register_parallel_patterns() -> list[type]:
    from tierwise_moe.expert_parallel import ExpertParallel
    from tierwise_moe.tensor_parallel import TensorParallel

    return [ExpertParallel, TensorParallel]


@hookimpl
def tierwise_register_settings() -> list[type]:
    return [MoESettings]


__all__ = [
    *_LAZY,
    "MoESettings",
    "__version__",
    "tierwise_register_parallel_patterns",
    "tierwise_register_settings",
]
