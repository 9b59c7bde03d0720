"""Core's default planner (used when no planner plugin answers).

Everything on the device when model data fits the device budget; otherwise parameters (and, if
still needed, optimizer states) go to host, with the smallest rCache that holds what one module
touches plus ``prefetch`` blocks, grown while the budget allows.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import replace
from functools import cache

from tierwise.chunks import first_use_order, pack, sharded_capacity
from tierwise.chunks.payload import MEMORY_TIERS, grad_offload_host_bytes, model_data_by_tier
from tierwise.config import Config
from tierwise.hardware import Hardware
from tierwise.plan import Plan, PlanError, io_buffer_bytes, resolve_policy, swap_target
from tierwise.planning.activation_peak import activation_peak
from tierwise.planning.cache_minimum import min_cache_blocks, recompute_blocks
from tierwise.planning.chunk_size import auto_chunk_sizes
from tierwise.planning.host_minimum import least_host_budget, restated, storage_tier_host_bytes
from tierwise.planning.host_share import in_node_units, rank_config
from tierwise.precision import PARAM_BYTES
from tierwise.profile import Profile, activation_blocks
from tierwise.units import format_bytes, format_gib

REDUCTION_BLOCKS = 2
"""Device blocks (of the largest chunk) that gradients in flight between ranks hold, whatever
the model's size and the world size: one being reduced while the next fills ([Note: bounded
gradient blocks] in tierwise.runtime.grads.reduce.blocks); a ``no_sync`` sum's upload lands in
one of them too, so ``no_sync`` adds no device memory to this count ([Note: no_sync buffers])."""


def reduction_blocks(config: Config) -> int:
    """Device blocks that gradients in flight between ranks hold at their worst moment: the
    pool of ``REDUCTION_BLOCKS``, plus, with ``reduce_order="rank"``, the receive block
    ([Note: reduction in rank order] in tierwise.runtime.grads.reduce.reducer)."""
    return REDUCTION_BLOCKS + (config.reduce_order == "rank")


def receive_block_numel(chunks: list[tuple[int, int]]) -> int:
    """Elements of the receive block of a reduction in rank order, for the reduced chunks given
    as (capacity, world size): the largest capacity rounded up to a multiple of its world size
    (as a sharded chunk's capacity is), so that every rank's pieces fit."""
    return max((sharded_capacity(cap, world, True)[0] for cap, world in chunks), default=0)


def _packing_orders(profile: Profile) -> dict[str, list[str]]:
    """Per group: its parameter names in packing (first-use) order, as setup packs them."""
    names_by_group: dict[str, list[str]] = defaultdict(list)
    for p in profile.params:
        names_by_group[p.group or "data/g0/train"].append(p.name)
    return {
        group: first_use_order(profile.forward_order, names)
        for group, names in names_by_group.items()
    }


def auto_chunk_sizes_of(profile: Profile) -> list[int]:
    """The "auto" chunk sizes core's planner tries, best first ([Note: chunk padding])."""
    numel = {p.name: p.numel for p in profile.params}
    return auto_chunk_sizes(
        [[numel[n] for n in names] for names in _packing_orders(profile).values()]
    )


def _layout(profile: Profile, chunk_size: int) -> dict[str, list[tuple[int, bool, set[str]]]]:
    """Per group: (capacity, trainable, names) of each chunk."""
    info = {p.name: p for p in profile.params}
    out = {}
    for group, names in _packing_orders(profile).items():
        specs = pack(names, {n: info[n].numel for n in names}, chunk_size)
        out[group] = [
            (s.capacity, info[names[0]].requires_grad, {x.name for x in s.slots}) for s in specs
        ]
    return out


def chunk_layout(profile: Profile, chunk_size: int) -> dict[str, list[tuple[int, bool, set[str]]]]:
    """Per chunk group: (capacity, trainable, parameter names) of each chunk the planner packs
    (in first-use order, as setup does)."""
    return _layout(profile, chunk_size)


def may_recompute(config: Config) -> bool:
    """Whether some block's forward may be re-run in backward (checkpointing, or an activation
    policy that can choose recompute)."""
    return bool(
        config.activation_checkpointing
        or config.activation_offload != "none"
        or config.activation_policy
    )


TRACED_ORDER = ("meta", "runtime")
"""Profile sources whose forward_order is the call order a step really follows (a static or
analytic profile's is module registration order)."""


def profile_min_blocks(profile: Profile, chunk_of: dict, *, recompute: bool) -> int:
    """[Note: the rCache minimum] for a profile; ``chunk_of`` maps first parameter names to
    the chunks that live in the rCache (aliases are added here)."""
    chunk_of = dict(chunk_of)
    for p in profile.params:
        if p.name in chunk_of:
            chunk_of.update(dict.fromkeys(p.aliases, chunk_of[p.name]))
    blocks = recompute_blocks(profile.module_params, profile.checkpoint_blocks) if recompute else ()
    traced = profile.forward_order if profile.source in TRACED_ORDER else ()
    return min_cache_blocks(profile.module_params, chunk_of, recompute=blocks, forward_order=traced)


def _min_blocks(profile: Profile, layout, config: Config, *, trainable_only: bool = False) -> int:
    """Most chunks pinned at one moment, every chunk in the rCache ([Note: the rCache minimum]);
    ``trainable_only``: only the trainable chunks go through it (device homes under the 14-byte
    variant, where frozen device homes compute in place: [Note: the 14-byte device home])."""
    chunk_of = {
        name: (group, i)
        for group, chunks in layout.items()
        for i, (_, trainable, names) in enumerate(chunks)
        if trainable or not trainable_only
        for name in names
    }
    return max(1, profile_min_blocks(profile, chunk_of, recompute=may_recompute(config)))


def planned_policy(profile: Profile, config: Config, auto: str | None = None) -> dict[str, str]:
    """Each profiled block's action as setup will resolve it (``tierwise.plan.resolve_policy``:
    an explicit ``activation_policy`` wins, planned as given), with ``auto`` as the plan's
    action for every block under ``activation_offload="auto"``."""
    blocks = list(activation_blocks(profile))
    return resolve_policy(
        blocks,
        policy=config.activation_policy if blocks else None,
        offload=config.activation_offload,
        checkpointing=config.activation_checkpointing,
        plan_policy=dict.fromkeys(blocks, auto) if auto else None,
    )


def device_activation_bytes(profile: Profile, config: Config, auto: str | None = None) -> int:
    """Peak activation bytes on the device under ``config``'s activation settings, each block
    given the action the runtime gives it (``planned_policy``), counted as [Note: activation
    peak under a policy]: a way to fit, counted as one."""
    return activation_peak(profile, planned_policy(profile, config, auto)).peak_bytes


def _auto_activations(
    profile: Profile, config: Config, budget, budget_for, need_on_device: int, reasons: list
):
    """Core's ``activation_offload="auto"``: recompute every block when keeping their
    activations would push model data off the device and recomputing lets it stay; else
    recompute every block from its inputs swapped to the host (LoHan's scheme) when that lets it
    stay; keep them otherwise. Blocks an explicit ``activation_policy`` names keep its action
    (``planned_policy``). (The search plugin weighs swapping against recomputing.)"""
    blocks = activation_blocks(profile)
    if not blocks:
        reasons.append("activations: auto, but the profile has no per-block activations: kept")
        return budget, {}
    recomputing = device_activation_bytes(profile, config, "recompute")
    budget_recompute = budget_for(recomputing)
    if budget is not None and budget < need_on_device <= budget_recompute:
        reasons.append(
            f"activations: recompute all {len(blocks)} blocks: keeping them "
            f"({format_bytes(profile.peak_activation_bytes)}) leaves {format_bytes(budget)} for "
            f"model data, which needs {format_bytes(need_on_device)} on the device"
        )
        return budget_recompute, {b: "recompute" for b in blocks}
    from_host = device_activation_bytes(profile, config, "recompute_host")
    budget_from_host = budget_for(from_host)
    if budget is not None and budget < need_on_device <= budget_from_host:
        reasons.append(
            f"activations: recompute all {len(blocks)} blocks from inputs swapped to the host: "
            f"keeping them leaves {format_bytes(budget)} for model data, recomputing from inputs "
            f"kept on the device {format_bytes(budget_recompute)}; it needs "
            f"{format_bytes(need_on_device)} on the device"
        )
        return budget_from_host, {b: "recompute_host" for b in blocks}
    why = (
        "device memory unknown"
        if budget is None
        else (
            "model data fits beside them"
            if budget >= need_on_device
            else "recomputing, from swapped inputs or not, would not keep model data on the "
            "device either"
        )
    )
    reasons.append(f"activations: keep all {len(blocks)} blocks ({why})")
    return budget, {b: "keep" for b in blocks}


def default_plan(
    *,
    profile: Profile,
    hardware: Hardware,
    config: Config,
    tier_classes: Mapping[str, type] | None = None,
) -> Plan:
    """The plan at ``config.chunk_size``; for "auto", at the first of ``auto_chunk_sizes_of``
    whose plan fits the budgets (when none does, the error at the last: the aim).
    ``tier_classes`` (the plugin host's, by name): the storage tiers whose own host buffers the
    host need counts ([Note: storage tiers' host buffers]); None counts none. A host refusal
    names the least host budget that plans ([Note: the stated host minimum is a fixed point]).
    ``config.host_memory`` is the node's: a rank plans with its share, and a refusal names the
    node's budget ([Note: a rank's host share])."""
    per_node = hardware.ranks_per_node
    rank = rank_config(config, per_node)
    try:
        return _plan_sizes(profile, hardware, rank, tier_classes or {})
    except PlanError as err:
        if err.tier != "host" or err.need is None or rank.host_memory is None:
            raise
        budget = least_host_budget(
            lambda need: _plan_sizes(
                profile, hardware, replace(rank, host_memory=need), tier_classes or {}
            ),
            err.need,
        )
        raise in_node_units(restated(err, budget), config.host_memory, per_node) from None


def _plan_sizes(
    profile: Profile, hardware: Hardware, config: Config, tier_classes: Mapping[str, type]
) -> Plan:
    if isinstance(config.chunk_size, int):
        return _plan_at(profile, hardware, config, config.chunk_size, tier_classes)
    sizes = auto_chunk_sizes_of(profile)
    for chunk_size in sizes[:-1]:
        try:
            return _plan_at(profile, hardware, config, chunk_size, tier_classes)
        except PlanError:
            continue  # a lean size that does not fit: try the next
    return _plan_at(profile, hardware, config, sizes[-1], tier_classes)


def _plan_at(
    profile: Profile,
    hardware: Hardware,
    config: Config,
    chunk_size: int,
    tier_classes: Mapping[str, type],
) -> Plan:
    lc = PARAM_BYTES[config.precision]
    layout = _layout(profile, chunk_size)
    dp_size = {
        (p.group or "data/g0/train"): p.dp_size or hardware.world_size for p in profile.params
    }
    # per chunk: (capacity, trainable, data-parallel size, ranks it is sharded over)
    caps = [
        (
            cap,
            trainable,
            dp_size.get(group, hardware.world_size),
            dp_size.get(group, hardware.world_size) if config.shard else 1,
        )
        for group, chunks in layout.items()
        for cap, trainable, _ in chunks
    ]
    # a block holds the largest chunk as setup builds it: sharded capacities rounded up to a
    # multiple of the ranks they are sharded over (chunks.sharded_capacity)
    block_bytes = max(sharded_capacity(cap, shards, shards > 1)[0] for cap, *_, shards in caps) * lc
    n_chunks = len(caps)
    n_sharded = sum(1 for *_, shards in caps if shards > 1)
    chunk_shards = [(-(-cap // shards), t, shards > 1) for cap, t, _, shards in caps]
    # [Note: the 14-byte device home]: bf16/fp16, unsharded trainable chunks on one rank only
    unsharded = [dp for _, t, dp, shards in caps if t and shards == 1]
    variant_ok = config.precision != "fp32" and bool(unsharded) and max(unsharded) == 1

    @cache
    def model_data(
        param_tier: str, optim_tier: str, in_home: bool = False, in_nvme_home: bool = False
    ) -> dict[str, int]:
        """Tier -> model data bytes as setup allocates them ([Note: payload spec], [Note:
        gradients in the parameter payload], ``in_home``: [Note: the 14-byte device home],
        ``in_nvme_home``: [Note: the 14-byte NVMe home]; Adam moments as stored: [Note:
        low-bit optimizer states])."""
        return model_data_by_tier(
            chunk_shards,
            precision=config.precision,
            optimizer_states=config.optimizer_states,
            param_tier=param_tier,
            optim_tier=optim_tier,
            grads_in_device_home=in_home,
            grads_in_nvme_home=in_nvme_home,
        )

    # gradients in flight between ranks: a fixed pool, [Note: bounded gradient blocks], and
    # the receive block of a reduction in rank order, [Note: reduction in rank order]
    reduced = [(cap, dp) for cap, t, dp, _ in caps if t and dp > 1]
    staging_blocks = reduction_blocks(config) if reduced else 0
    staging_bytes = REDUCTION_BLOCKS * block_bytes if reduced else 0
    if reduced and config.reduce_order == "rank":
        staging_bytes += receive_block_numel(reduced) * lc
    min_blocks = _min_blocks(profile, layout, config)
    # the 14-byte variant caches the trainable device homes only
    n_trainable = sum(1 for _, trainable, *_ in caps if trainable)
    in_home_min_blocks = _min_blocks(profile, layout, config, trainable_only=True)

    reasons = []

    def device_need(param_tier: str, optim_tier: str, blocks: int, in_home: bool = False) -> int:
        return (
            blocks * block_bytes
            + staging_bytes
            + model_data(param_tier, optim_tier, in_home).get("device", 0)
        )

    def blocks_for(param_tier: str, in_home: bool = False) -> int:
        if param_tier == "device" and not in_home:  # sharded: keep every gathered one (ZeRO-2)
            return n_sharded
        if in_home:
            return min(n_trainable, in_home_min_blocks + config.prefetch)
        return min(n_chunks, min_blocks + config.prefetch)

    def budget_for(activation_bytes: int) -> int | None:
        if config.device_memory is not None:
            return config.device_memory
        if hardware.device_type == "cuda" and hardware.device_memory is not None:
            return int(
                config.alloc_fraction
                * (
                    hardware.device_memory
                    - profile.buffer_bytes
                    - config.frag_factor * activation_bytes
                )
            )
        return None

    budget = budget_for(device_activation_bytes(profile, config))
    activation_policy: dict[str, str] = {}
    if config.activation_offload == "auto":
        budget, activation_policy = _auto_activations(
            profile,
            config,
            budget,
            budget_for,
            device_need("device", "device", blocks_for("device")),
            reasons,
        )
    fits = lambda p, o, b, v=False: budget is None or device_need(p, o, b, v) <= budget  # noqa: E731
    forced_p = None if config.param_placement == "auto" else config.param_placement
    forced_o = None if config.optimizer_placement == "auto" else config.optimizer_placement
    forced_blocks = config.cache_blocks if isinstance(config.cache_blocks, int) else None
    placements = [("device", "device"), ("host", "device"), ("host", "host")]
    if forced_p and forced_o:
        placements = [(forced_p, forced_o)]
    # each placement with 16 bytes first, then (a device home) the 14-byte variant
    candidates = [
        (forced_p or p, forced_o or o, in_home)
        for p, o in placements
        for in_home in (False, True)
        if not in_home or ((forced_p or p) == "device" and variant_ok)
    ]
    for p_tier, o_tier, in_home in candidates:
        # a forced cache_blocks is what the placement must fit with
        blocks = forced_blocks if forced_blocks is not None else blocks_for(p_tier, in_home)
        if fits(p_tier, o_tier, blocks, in_home):
            break
    param_tier, optim_tier = p_tier, o_tier
    # the chunks that go through the rCache under the variant: the trainable ones
    least_blocks, cacheable = (
        (in_home_min_blocks, n_trainable) if in_home else (min_blocks, n_chunks)
    )
    if not (forced_p and forced_o):
        reasons.append(
            f"model data {format_bytes(sum(model_data(param_tier, optim_tier, in_home).values()))}"
            " vs device budget "
            f"{format_bytes(budget) if budget is not None else 'unlimited'}: params on {param_tier}, "
            f"optimizer states on {optim_tier}"
        )
    if in_home:
        reasons.append(
            "gradients kept in the device homes (14 bytes per element; the 16-byte plan needs "
            f"{format_bytes(device_need(param_tier, optim_tier, blocks_for(param_tier)))} on the "
            "device): the chunks compute in rCache blocks"
        )
    if forced_blocks is not None:
        cache_blocks = forced_blocks
    else:
        cache_blocks = blocks_for(param_tier, in_home)
        if param_tier == "device" and n_sharded and not fits(param_tier, optim_tier, cache_blocks):
            cache_blocks = min(n_sharded, min_blocks + config.prefetch)
        while cache_blocks > 0 and not fits(param_tier, optim_tier, cache_blocks, in_home):
            cache_blocks -= 1
        if param_tier != "device" or n_sharded or in_home:
            cache_blocks = max(cache_blocks, least_blocks)
            if budget is not None and cache_blocks < cacheable:
                spare = budget - device_need(param_tier, optim_tier, cache_blocks, in_home)
                cache_blocks = min(cacheable, cache_blocks + max(0, spare // block_bytes))
    need = device_need(param_tier, optim_tier, cache_blocks, in_home)
    if budget is not None and need > budget:
        raise _device_binds(
            need=need,
            budget=budget,
            param_tier=param_tier,
            optim_tier=optim_tier,
            cache_blocks=cache_blocks,
            forced_blocks=forced_blocks,
            min_blocks=least_blocks,
            staging_blocks=staging_blocks,
            block_bytes=block_bytes,
            smallest=lambda blocks: device_need(
                forced_p or "host", forced_o or "host", blocks, in_home
            ),
            smallest_tiers=(forced_p or "host", forced_o or "host"),
        )
    reasons.append(
        f"{cache_blocks} rCache blocks of {chunk_size:,} elements (at most {least_blocks} "
        f"chunks are in use at once; prefetch {config.prefetch})"
    )
    largest = max(p.numel for p in profile.params)
    io_bytes = io_buffer_bytes(largest, max(cap for cap, *_ in caps))
    # what setup puts there: model data, the gradient offload buffers and the storage tiers'
    # own host buffers, sized as setup sizes them (reserve_storage_buffers)
    widest = 4 * (block_bytes // lc)  # the largest chunk in fp32: the widest transfer
    shard_bytes = 4 * max((shard for shard, *_ in chunk_shards), default=0)
    holds_states = {optim_tier} if any(t for _, t, _ in chunk_shards) else set()
    actions = {*planned_policy(profile, config).values(), *activation_policy.values()}
    swaps = {swap_target(action) for action in actions} - {None}
    storage_bytes = sum(
        storage_tier_host_bytes(
            tier_classes.get(tier),
            config,
            shard_bytes if tier in holds_states else 0,
            transfer_bytes=widest,
            ranks_per_node=hardware.ranks_per_node,
        )
        for tier in sorted(({param_tier, optim_tier} | swaps) - {"device", "host"})
    )

    def host_bytes(in_nvme_home: bool) -> int:
        data = model_data(param_tier, optim_tier, in_home, in_nvme_home).get("host", 0)
        return (
            data
            + storage_bytes
            + grad_offload_host_bytes(
                chunk_shards,
                precision=config.precision,
                param_tier=param_tier,
                optim_tier=optim_tier,
                pinned=hardware.device_type == "cuda",
                grads_in_nvme_home=in_nvme_home,
            )
        )

    host_data = host_bytes(False)
    # [Note: the 14-byte NVMe home]: only when the 16-byte plan misses the host budget
    in_nvme_home = (
        config.precision != "fp32"
        and param_tier not in MEMORY_TIERS
        and optim_tier == "host"
        and any(trainable for _, trainable, _ in chunk_shards)
        and config.host_memory is not None
        and host_data > config.host_memory
    )
    if in_nvme_home:
        reasons.append(
            "gradients kept in the NVMe homes (14 bytes per element, through the host gradient "
            f"buffers; the 16-byte plan needs {format_bytes(host_data)} of host memory): "
            "backward spills them over the homes, the update reads them back"
        )
        host_data = host_bytes(True)
    _check_host(config, host_data, io_bytes, param_tier, optim_tier, reasons, in_nvme_home)
    return Plan(
        chunk_size=chunk_size,
        cache_blocks=cache_blocks,
        prefetch=config.prefetch,
        param_tier=param_tier,
        optim_tier=optim_tier,
        shard=config.shard,
        grads_in_device_home=in_home,
        grads_in_nvme_home=in_nvme_home,
        activation_checkpointing=config.activation_checkpointing,
        activation_policy=activation_policy,
        device_allowance=need,
        host_need=host_data,
        io_buffer_bytes=io_bytes,
        planner="core",
        reasons=reasons,
    )


def _check_host(
    config: Config,
    host_data: int,
    io_bytes: int,
    param_tier: str,
    optim_tier: str,
    reasons: list,
    in_nvme_home: bool = False,
) -> None:
    """Refuse a plan whose host model data exceeds ``host_memory``. The load/save buffers
    (``Plan.io_buffer_bytes``) are not part of that need: they are taken only while weights
    load or save ([Note: load/save buffers are not held through training] in tierwise.plan); a
    reason says when the host budget has no room for them beside the model data."""
    if config.host_memory is not None and host_data + io_bytes > config.host_memory >= host_data:
        reasons.append(
            f"load/save buffers: {format_gib(io_bytes)} while weights load or save do not fit "
            f"beside {format_gib(host_data)} of host model data in a rank's host budget of "
            f"{format_gib(config.host_memory)} (its share of host_memory: [Note: a rank's host "
            "share]): training fits; setup(weights=...) and save_pretrained (checked at setup "
            "with Config.saves_weights) need a rank's host budget of at least "
            f"{format_gib(host_data + io_bytes)}"
        )
    if config.host_memory is None or host_data <= config.host_memory:
        return
    variant = ", gradients in the NVMe homes" if in_nvme_home else ""
    raise PlanError(
        f"host memory binds: this plan (params on {param_tier}, optimizer on {optim_tier}"
        f"{variant}) needs {format_gib(host_data)} of host memory for model data, gradient "
        "buffers and storage tiers' host buffers, host_memory is "
        f"{format_gib(config.host_memory)}: {format_gib(host_data - config.host_memory)} short; "
        "raise host_memory, or set nvme_path and place model data on NVMe",
        tier="host",
        need=host_data,
        limit=config.host_memory,
    )


def _device_binds(
    *,
    need: int,
    budget: int,
    param_tier: str,
    optim_tier: str,
    cache_blocks: int,
    forced_blocks: int | None,
    min_blocks: int,
    staging_blocks: int,
    block_bytes: int,
    smallest: Callable[[int], int],
    smallest_tiers: tuple[str, str],
) -> PlanError:
    """The one-line error when the device budget binds. The numbers it quotes are those of the
    smallest plan the user's forced settings allow, so the minimum it names is never below the
    budget it rejected; when only a forced ``cache_blocks`` is too large, it says how many fit."""
    this = (
        f"device memory binds: this plan needs {format_gib(need)} on the device (params on "
        f"{param_tier}, optimizer on {optim_tier}, {cache_blocks} rCache blocks + "
        f"{staging_blocks} gradient staging blocks of {format_bytes(block_bytes)}), "
        f"device_memory allows {format_gib(budget)}: {format_gib(need - budget)} short."
    )
    p_tier, o_tier = smallest_tiers
    smallest_need = smallest(min_blocks)
    if forced_blocks is not None and forced_blocks > min_blocks and smallest_need <= budget:
        most = min_blocks + (budget - smallest_need) // block_bytes
        return PlanError(
            f"{this} cache_blocks={forced_blocks} is what binds: at most {most} rCache blocks fit "
            f"(at least {min_blocks} are needed, params on {p_tier}, optimizer on {o_tier}); set "
            f"cache_blocks to at most {most} or 'auto', or raise device_memory to at least "
            f"{format_gib(need)}",
            tier="device",
            need=need,
            limit=budget,
        )
    forced = [f"params on {p_tier}", f"optimizer on {o_tier}", f"{min_blocks} rCache blocks"]
    lower = (
        f"lower cache_blocks to {min_blocks} and "
        if forced_blocks is not None and forced_blocks > min_blocks
        else ""
    )
    return PlanError(
        f"{this} The smallest plan ({', '.join(forced)}) needs {format_gib(smallest_need)}: "
        f"{lower}raise device_memory to at least that, or use a smaller chunk_size",
        tier="device",
        need=smallest_need,
        limit=budget,
    )
