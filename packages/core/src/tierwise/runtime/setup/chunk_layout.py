"""Setup stage 4, layout: each chunk group's parameters packed in first-use order into chunks
(no memory yet), recorded in the plan, and the plan's rCache checked against the layout."""

from __future__ import annotations

from collections import OrderedDict

import torch

from tierwise.chunks import ChunkGroup, ParamSlot, SlotSpec
from tierwise.config import Config, ConfigError
from tierwise.plan import RECOMPUTE_ACTIONS, Plan
from tierwise.plan import io_buffer_bytes as plan_io_buffer_bytes
from tierwise.planning.planner import may_recompute, profile_min_blocks
from tierwise.precision import compute_dtype
from tierwise.profile import Profile
from tierwise.runtime.layout.packing import packed_chunks
from tierwise.runtime.setup.patterns import Patterns
from tierwise.runtime.setup.planning import Planned
from tierwise.runtime.setup.profiling import ManagedParam, Profiled


def lay_out(
    config: Config,
    *,
    patterns: Patterns,
    profiled: Profiled,
    planned: Planned,
) -> list[ChunkGroup]:
    """The chunk groups of the planned model, recorded in ``planned.plan`` (``groups``,
    ``io_buffer_bytes``); raises when the plan's rCache is below the layout's minimum."""
    plan = planned.plan
    dtype = compute_dtype(config.precision)
    groups = layout_groups(
        profiled.params, profiled.profile, plan, dtype, world_rank=patterns.world_rank
    )
    plan.groups = {
        g.name: {
            "pattern": g.pattern_key,
            "dp_size": g.world,
            "sharded": g.sharded,
            "chunks": len(g.chunks),
            "trainable": g.trainable,
        }
        for g in groups
    }
    plan.io_buffer_bytes = io_buffer_bytes(groups)
    _check_cache_minimum(config, profiled.profile, planned, groups)
    return groups


def layout_groups(
    params: OrderedDict[str, ManagedParam],
    profile: Profile,
    plan: Plan,
    dtype: torch.dtype,
    *,
    world_rank: dict[str, tuple[object, int, int]],
) -> list[ChunkGroup]:
    """Pack each chunk group's parameters in first-use order into chunks (no memory yet).

    ``world_rank`` maps a pattern key to (process group, world size, rank) of its DP group.
    """
    names_by_group: OrderedDict[str, list[str]] = OrderedDict()
    for m in params.values():
        names_by_group.setdefault(m.group_name, []).append(m.name)
    groups = []
    for group_name, names in names_by_group.items():
        first = params[names[0]]
        pg, world, rank = world_rank[first.pattern.key]
        sharded = plan.shard and world > 1
        trainable = first.param.requires_grad
        if plan.grads_in_device_home and trainable:
            _check_grads_in_device_home(group_name, dtype, world, sharded)
        if plan.grads_in_nvme_home and trainable and dtype == torch.float32:
            raise ConfigError(  # [Note: the 14-byte NVMe home]
                "the plan asks for grads_in_nvme_home, which keeps bf16/fp16 gradients in "
                "their parameter payload; with precision='fp32' the gradients need 4 bytes of "
                "their own: set grads_in_nvme_home=False or use bf16/fp16"
            )
        group = ChunkGroup(
            name=group_name,
            pattern_key=first.pattern.key,
            param_group=first.param_group,
            trainable=trainable,
            dtype=dtype,
            process_group=pg,
            world=world,
            rank=rank,
            sharded=sharded,
            grads_in_device_home=plan.grads_in_device_home and trainable and not sharded,
            grads_in_nvme_home=plan.grads_in_nvme_home and trainable,
        )

        def make_slot(s: SlotSpec) -> ParamSlot:
            param = params[s.name].param
            return ParamSlot(s.name, param, s.offset, s.numel, param.shape)

        numels = {n: params[n].param.numel() for n in names}
        group.chunks.extend(
            packed_chunks(group, profile.forward_order, numels, plan.chunk_size, make_slot)
        )
        groups.append(group)
    return groups


def _check_grads_in_device_home(group: str, dtype: torch.dtype, world: int, sharded: bool) -> None:
    """Refuse ``Plan.grads_in_device_home`` where it cannot hold ([Note: the 14-byte device
    home]): fp32 has no 2-byte home to reuse, and replicated chunks on several ranks reduce
    into a gradient shard."""
    if dtype == torch.float32:
        raise ConfigError(
            "the plan asks for grads_in_device_home, which keeps bf16/fp16 gradients in their "
            "parameter payload; with precision='fp32' the gradients need 4 bytes of their own: "
            "set grads_in_device_home=False or use bf16/fp16"
        )
    if world > 1 and not sharded:
        raise ConfigError(
            f"the plan asks for grads_in_device_home, but group {group} is replicated over "
            f"{world} ranks (shard=False), whose gradients are all-reduced into a gradient "
            "shard: set shard=True (sharded device homes keep their gradients in place already) "
            "or grads_in_device_home=False"
        )


def io_buffer_bytes(groups: list[ChunkGroup]) -> int:
    """Host bytes loading pretrained weights and streaming them out hold at most (see
    ``Plan.io_buffer_bytes``): the largest parameter twice in fp32 (the buffer read, its
    conversion), two fill pieces (fp32 and the compute copy) and one gathered chunk in fp32."""
    largest = max((s.numel for g in groups for c in g.chunks for s in c.slots), default=0)
    chunk = max((c.capacity for g in groups for c in g.chunks), default=0)
    return plan_io_buffer_bytes(largest, chunk)


def _check_cache_minimum(config: Config, profile: Profile, planned: Planned, groups) -> None:
    """Refuse a plan with fewer rCache blocks than the step needs ([Note: the rCache
    minimum]), before anything is allocated."""
    plan = planned.plan
    chunk_of = {
        slot.name: chunk.key
        for g in groups
        for chunk in g.chunks
        for slot in chunk.slots
        if g.device_home_cached or plan.param_tier_of(g.name, chunk.index) != "device"
    }
    recompute = (
        may_recompute(config)
        or plan.activation_checkpointing
        or planned.hf_checkpointing
        or any(a in RECOMPUTE_ACTIONS for a in plan.activation_policy.values())
    )
    minimum = profile_min_blocks(profile, chunk_of, recompute=recompute)
    if plan.cache_blocks < minimum:
        raise ConfigError(
            f"cache_blocks={plan.cache_blocks} is below this model's minimum of {minimum} rCache "
            f"blocks at chunk_size {plan.chunk_size} (the most chunks in use at one moment of a "
            f"step): set cache_blocks ≥ {minimum}, or leave it on 'auto'"
        )
