"""What a plan holds in host memory beside its model data, and the least host budget that plans
when that grows with the budget.

[Note: the stated host minimum is a fixed point]
A storage tier sizes its own host buffers against ``host_memory`` (the NVMe tier's staged-read
pool and optimizer pipeline take up to HOST_FRACTION of it, never less than their floor), so the
host need a planner states at a small budget can be short of what planning at that very budget
needs: at 1 byte the pools are at their floor and the refusal named 4.38 MiB; at 4.38 MiB they
are larger and planning asked for 4.55 MiB. A refusal must name a budget that plans, so the
planners restate it as the least fixed point: starting from the refusal's need, plan again at
the need until planning there needs no more than the budget. The need never shrinks as the
budget grows (the pools only grow), so this climbs from below and stops at the least budget
that plans, not at some larger one.
"""

from __future__ import annotations

from collections.abc import Callable

from tierwise.plan import Plan, PlanError, load_buffer_minimum, save_buffer_bytes
from tierwise.planning.host_share import rank_host_share
from tierwise.units import format_gib


def storage_tier_host_bytes(
    tier_class: type | None,
    config,
    optimizer_buffer_bytes: int = 0,
    *,
    transfer_bytes: int = 0,
    ranks_per_node: int = 1,
) -> int:
    """Host bytes a storage tier of ``tier_class`` made with ``config`` holds in its own buffers
    when its transfers move at most ``transfer_bytes`` and, with ``optimizer_buffer_bytes``, its
    optimizer pipeline's buffers are that large: the tier's ``planned_host_buffer_bytes``, the
    figure setup reserves in the host tier ([Note: storage tiers' host buffers]); 0 for a class
    without host buffers (or None). Both planners count them with this, on a node of the plan's
    hardware's ``ranks_per_node`` ranks, whose share of the available RAM bounds the pools when
    ``config`` has no host_memory ([Note: a rank's host share])."""
    planned = getattr(tier_class, "planned_host_buffer_bytes", None)
    if planned is None:
        return 0
    return planned(
        config,
        optimizer_buffer_bytes=optimizer_buffer_bytes,
        transfer_bytes=transfer_bytes,
        ranks_per_node=ranks_per_node,
    )


MAX_ROUNDS = 64
"""Plans tried at most: the pools have a bounded number of sizes (buffers up to the disk's
queue depth, a read-ahead of at most a few chunks), so the climb ends well before this."""


def least_host_budget(
    plan_at: Callable[[int], Plan],
    start: int,
    *,
    extra: Callable[[Plan], int] | None = None,
    ranks_per_node: int = 1,
) -> int:
    """The least budget from ``start`` up at which ``plan_at(budget)`` (planning with that host
    budget) needs at most the budget: its ``Plan.host_need`` plus ``extra(plan)`` (0 without),
    times ``ranks_per_node`` when the budget is a node's and the plan a rank's ([Note: a rank's
    host share]), or a host refusal's need. Stops at the first budget whose planning fails on
    another tier."""
    budget = start
    for _ in range(MAX_ROUNDS):
        try:
            plan = plan_at(budget)
        except PlanError as err:
            if err.tier != "host" or err.need is None:
                return budget
            need = err.need
        else:
            need = (plan.host_need or 0) + (extra(plan) if extra is not None else 0)
            need *= max(1, ranks_per_node)
        if need <= budget:
            return budget
        budget = need
    raise PlanError(
        f"planning with host_memory {format_gib(start)} and up needed more host memory each "
        f"time, {MAX_ROUNDS} times (last asked {format_gib(budget)}): the storage tiers' host "
        "buffers do not settle; set host_memory well above that, or report this"
    )


def plan_for_weight_load(
    plan_at: Callable[[int | None], Plan],
    host_memory: int | None,
    *,
    largest_numel: int,
    itemsize: int,
    ranks_per_node: int = 1,
    loads: bool = True,
    saves: bool = False,
) -> Plan:
    """[Note: the weight load checked at plan time]
    The load/save buffers are not held through training ([Note: load/save buffers are not held
    through training] in tierwise.plan), but loading pretrained weights takes them beside
    everything the plan holds in the host tier, down to their minimum (``load_buffer_minimum``,
    the loader's own figure), and ``save_pretrained`` takes them whole (``save_buffer_bytes``,
    the saver's own figure). So a run that ``loads`` or ``saves`` weights plans
    (``plan_at(host_memory)``) and, before any model data is built, checks that
    ``Plan.host_need`` plus the larger of those (load and save never run at once) fits
    ``host_memory``. A refusal, the planner's or this one, names the least budget at which
    planning again leaves that room (the storage tiers' buffers grow with the budget, and a
    search may fill a larger budget with model data: [Note: the stated host minimum is a fixed
    point]). ``itemsize``: bytes per element of the compute precision. ``host_memory`` is the
    node's, shared by ``ranks_per_node`` ranks: a rank's need is checked against its share and a
    refusal names the node's budget ([Note: a rank's host share]). Setup does this for
    ``setup(weights=...)`` (so ``tierwise train --from-pretrained``) and
    ``Config.saves_weights``, ``tierwise plan`` for ``--load-weights`` and ``--save-weights``."""

    per_node = max(1, ranks_per_node)

    def least(plan: Plan) -> int:
        load = load_buffer_minimum(plan.io_buffer_bytes or 0, largest_numel, itemsize)
        save = save_buffer_bytes(plan.io_buffer_bytes)
        return max(load if loads else 0, save if saves else 0)

    what = " and ".join(w for w, on in (("loading", loads), ("saving", saves)) if on)
    does = " and ".join(w for w, on in (("loads", loads), ("saves", saves)) if on)
    try:
        plan = plan_at(host_memory)
    except PlanError as err:
        if err.tier != "host" or err.need is None or host_memory is None:
            raise
        budget = least_host_budget(plan_at, err.need, extra=least, ranks_per_node=per_node)
        raise PlanError(
            f"{err}; {what} pretrained weights also needs its load/save buffers beside that: "
            f"the least host_memory that plans{',' if loads and saves else ' and'} {does} is "
            f"{format_gib(budget)}",
            tier="host",
            need=budget,
            limit=host_memory,
        ) from None
    if host_memory is None or plan.host_need is None or not (loads or saves):
        return plan
    need = plan.host_need + least(plan)
    share = rank_host_share(host_memory, per_node)
    if need <= share:
        return plan
    budget = least_host_budget(plan_at, need * per_node, extra=least, ranks_per_node=per_node)
    node = f" (the node's, shared by {per_node} ranks: {format_gib(share)} each)"
    buffers = (
        "the whole load/save buffers"
        if saves and save_buffer_bytes(plan.io_buffer_bytes) >= least(plan)
        else "two pieces of the largest parameter, or the whole load/save buffers when smaller"
    )
    raise PlanError(
        f"host memory binds while weights {'load' if not saves else 'save'}: {what} pretrained "
        f"weights needs {format_gib(least(plan))} of buffers ({buffers}) beside the "
        f"{format_gib(plan.host_need)} this plan holds in host memory, {format_gib(need)} in all"
        f"{' on each rank' if per_node > 1 else ''}; host_memory is {format_gib(host_memory)}"
        f"{node if per_node > 1 else ''}: {format_gib(need - share)} short"
        f"{' per rank' if per_node > 1 else ''}; raise host_memory to at least {format_gib(budget)}",
        tier="host",
        need=budget,
        limit=host_memory,
    )


def restated(err: PlanError, budget: int) -> PlanError:
    """``err`` (a host refusal) naming ``budget``, the least host budget that plans, as its need
    when that is above what it named ([Note: the stated host minimum is a fixed point])."""
    if err.need is None or budget <= err.need:
        return err
    return PlanError(
        f"{err} to at least {format_gib(budget)} (at host_memory {format_gib(err.need)} the "
        "storage tiers' host buffers, sized against host_memory, are larger: the least "
        f"host_memory that plans is {format_gib(budget)})",
        tier="host",
        need=budget,
        limit=err.limit,
    )


__all__ = [
    "MAX_ROUNDS",
    "plan_for_weight_load",
    "least_host_budget",
    "restated",
    "storage_tier_host_bytes",
]
