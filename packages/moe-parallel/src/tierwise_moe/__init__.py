"""tierwise-moe: expert-parallel and tensor-parallel patterns for fine-grained plans."""

from __future__ import annotations

from tierwise.hookspecs import hookimpl
from tierwise.parallel import ParallelPattern
from tierwise.plugins import not_implemented

from tierwise_moe._version import __version__


class _Placeholder(ParallelPattern):
    def __init__(self, **kwargs):
        raise not_implemented(f"the {self.PLUGIN_NAME!r} parallel pattern", "tierwise-moe")

    claims = dp_group = __init__


class ExpertParallel(_Placeholder):
    PLUGIN_NAME = "expert"


class TensorParallel(_Placeholder):
    PLUGIN_NAME = "tensor"


@hookimpl
def tierwise_register_parallel_patterns() -> list[type]:
    return [ExpertParallel, TensorParallel]


__all__ = ["ExpertParallel", "TensorParallel", "__version__", "tierwise_register_parallel_patterns"]
