"""The README's example plugin, verbatim (tests check the two stay identical)."""

from tierwise.hookspecs import hookimpl
from tierwise.parallel import DataParallel
from tierwise.tiers import HostTier


class ScratchTier(HostTier):
    """Host memory under another name: a second RAM tier for experiments."""

    PLUGIN_NAME = "scratch"


class ReplicatedPattern(DataParallel):
    """Data parallel without sharding: every rank keeps whole chunks."""

    PLUGIN_NAME = "replicated"

    def dp_group(self):
        return None


@hookimpl
def tierwise_register_tiers():
    return [ScratchTier]


@hookimpl
def tierwise_register_parallel_patterns():
    return [ReplicatedPattern]
