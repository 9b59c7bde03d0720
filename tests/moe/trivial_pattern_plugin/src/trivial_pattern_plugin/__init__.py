"""A third-party parallel pattern: normalisation weights in their own chunk group.

It shows a new pattern needs no change in tierwise: it claims every parameter of a module whose
class name ends in "Norm" (RMSNorm, LayerNorm), shards it over the whole world like data
parallelism, and leaves the modules' compute unchanged.
"""

from tierwise.hookspecs import hookimpl
from tierwise.parallel import ParallelPattern


class NormsApart(ParallelPattern):
    """Norm weights chunked and sharded on their own, over the run's world."""

    PLUGIN_NAME = "norms_apart"

    def prepare(self, model):
        self._names = {
            f"{module_name}.{name}"
            for module_name, module in model.named_modules()
            if type(module).__name__.endswith("Norm")
            for name, _ in module.named_parameters(recurse=False)
        }

    def claims(self, name, param):
        return name in self._names

    def dp_group(self):
        return self.process_group


@hookimpl
def tierwise_register_parallel_patterns():
    return [NormsApart]
