"""A rank's share of its node's host memory, and host refusals stated in the node's units.

[Note: a rank's host share]
``Config.host_memory`` is the node's: the ranks on one node share its RAM. Each rank plans and
runs with ``host_memory // ranks_per_node`` of it (``rank_host_share``): core's planner and the
search check a rank's host need against that share, setup gives the rank's host tier that
budget, and the storage tiers size their host pools against it (they get ``rank_config``);
without a host_memory, against the rank's share of the RAM available (tierwise_nvme's
``host_bytes``), as the warm-up re-layout's guard does. So the host tiers of a node's ranks
together never hold more than ``host_memory``.
``ranks_per_node`` is always ``Hardware.ranks_per_node`` of the hardware the plan is made for:
``gpus_per_node`` when given, else min(world_size, 8). At run time the probe fills
``gpus_per_node`` from ``LOCAL_WORLD_SIZE`` (torchrun sets it; without it, min(world, 8), so
ranks started by hand on one node, as the gloo tests do, share one node up to 8 ranks), so
``tierwise plan --gpus-per-node N`` and a run on N local ranks plan with the same share.
``pinned_memory`` is a rank's: its page-locked buffers are reserved inside the rank's host
tier, so they stay within its share, and the node's sum within ``host_memory``.
A refusal states the node budget that would plan: a rank's need times ``ranks_per_node``
(``in_node_units``), the unit the user gave.
"""

from __future__ import annotations

import dataclasses

from tierwise.config import Config
from tierwise.plan import PlanError
from tierwise.units import format_gib


def rank_host_share(host_memory: int | None, ranks_per_node: int) -> int | None:
    """This rank's host budget: the node's ``host_memory`` over its ``ranks_per_node`` ranks
    (None: no budget); at least 1 byte, as a budget is (Config refuses 0), so a node budget of
    fewer bytes than ranks is refused with the need a rank states, not planned at nothing."""
    if host_memory is None:
        return None
    return max(1, host_memory // max(1, ranks_per_node))


def rank_config(config: Config, ranks_per_node: int) -> Config:
    """``config`` as one rank plans and runs with it: ``host_memory`` its share."""
    share = rank_host_share(config.host_memory, ranks_per_node)
    if share == config.host_memory:
        return config
    return dataclasses.replace(config, host_memory=share)


def in_node_units(err: PlanError, host_memory: int | None, ranks_per_node: int) -> PlanError:
    """``err``, a rank's refusal at its share of ``host_memory``, restated for the node: its
    need is the node budget that gives each rank what it needs. Other refusals as they are."""
    if ranks_per_node <= 1 or err.tier != "host" or err.need is None or host_memory is None:
        return err
    node_need = err.need * ranks_per_node
    return PlanError(
        f"host_memory {format_gib(host_memory)} (the node's, shared by {ranks_per_node} ranks: "
        f"{format_gib(rank_host_share(host_memory, ranks_per_node))} each) is too small: each "
        f"rank needs {format_gib(err.need)}, so raise host_memory to at least "
        f"{format_gib(node_need)} ({ranks_per_node} × {format_gib(err.need)}). A rank's planner, "
        f"at its share, said: {err}",
        tier="host",
        need=node_need,
        limit=host_memory,
    )


__all__ = ["in_node_units", "rank_config", "rank_host_share"]
