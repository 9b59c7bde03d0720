"""A third-party parallel pattern: normalisation weights in a chunk group of their own.

It shows that a new pattern needs no change in tierwise: it claims the parameters of modules
whose name ends in "norm" (input_layernorm, model.norm, ...), shards their chunks over the whole
world like data parallelism, and leaves the model's compute unchanged.
"""

from tierwise.hookspecs import hookimpl
from tierwise.parallel import ParallelPattern


class NormsApart(ParallelPattern):
    """Norm weights chunked and sharded on their own, over the run's world."""

    PLUGIN_NAME = "norms_apart"

    def claims(self, name, param):
        module_name = name.rpartition(".")[0]
        return module_name.lower().endswith("norm")

    def dp_group(self):
        return self.process_group


@hookimpl
def tierwise_register_parallel_patterns():
    return [NormsApart]
