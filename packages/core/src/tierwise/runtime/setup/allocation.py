"""Setup stage 5, allocation: the tiers the plan needs, every chunk's slabs as its
``PayloadSpec`` says ([Note: payload spec]), the host buffers of storage tiers, gradient
offload and activation swaps, and the rCache blocks. Nothing on the model changes; on failure
everything allocated is released ([Note: a failed setup closes its tiers])."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tierwise.chunks import ChunkGroup, OptimSlabs
from tierwise.chunks.payload import PayloadSpec
from tierwise.config import Config, ConfigError
from tierwise.plan import Plan, swap_target
from tierwise.planning.host_share import rank_config
from tierwise.plugins import PluginHost
from tierwise.precision import OPTIM_STATES, compute_dtype
from tierwise.runtime.activations.pinned_pool import pinned_swap_bytes
from tierwise.runtime.grads.offload import GradientOffload, gradient_offload_for
from tierwise.runtime.residency.rcache import RCache
from tierwise.runtime.setup.planning import Planned
from tierwise.tiers.base import PayloadKind, Tier


@dataclass(frozen=True, kw_only=True)
class Allocation:
    """What the allocation stage holds for the engine."""

    tiers: dict[str, Tier]
    """Tier name -> tier (every one the plan names, and the device and host tiers)."""
    cache: RCache
    """The rCache's device blocks."""
    grad_offload: GradientOffload | None
    """Host buffers in front of gradient shards on a storage tier (None: none are)."""

    def release(self, groups: list[ChunkGroup]) -> None:
        """Give everything back (a setup that failed after this stage)."""
        release_payloads(groups)
        self.cache.close()
        if self.grad_offload is not None:
            self.grad_offload.close()
        for tier in self.tiers.values():
            tier.close()


def allocate(
    config: Config, *, host: PluginHost, planned: Planned, groups: list[ChunkGroup]
) -> Allocation:
    """Make the tiers and allocate every slab and buffer the plan needs."""
    plan = planned.plan
    dtype = compute_dtype(config.precision)
    needed = {plan.param_tier_of(g.name, c.index) for g in groups for c in g.chunks}
    needed |= {plan.optim_tier_of(g.name, c.index) for g in groups if g.trainable for c in g.chunks}
    needed |= {swap_target(a) for a in plan.activation_policy.values()} - {None}
    tiers: dict = {}
    allocated: list = []
    grad_offload = None
    try:  # [Note: a failed setup closes its tiers]
        # [Note: a rank's host share]: this rank's tiers hold its share of the node's host_memory
        rank = rank_config(config, planned.hardware.ranks_per_node)
        _make_tiers(host, rank, plan, needed, into=tiers)
        allocated = allocate_payloads(groups, plan, tiers, _payloads(config, groups))
        pinned = pinned_swap_bytes(config, plan.activation_policy if planned.blocks else {})
        if pinned:  # the activation swaps' page-locked buffers count in host_memory
            tiers["host"].reserve(
                pinned, kind=PayloadKind.STAGING, what="pinned activation buffers (pinned_memory)"
            )
        reserve_storage_buffers(groups, plan, tiers)
        grad_offload = gradient_offload_for(groups, tiers, dtype)
        cached = [c for g in groups for c in g.chunks if not c.computes_in_home]
        block_numel = max((c.capacity for c in cached), default=0)
        cache = RCache(tiers["device"], plan.cache_blocks if cached else 0, block_numel, dtype)
        if cached and len(cache) == 0:
            raise ConfigError(
                "the plan keeps parameters off the device but has cache_blocks=0: set "
                "cache_blocks ≥ 1 (or 'auto')"
            )
    except BaseException:
        # [Note: a failed setup closes its tiers]
        # A tier may hold more than memory: the NVMe tier's swap files and their descriptors.
        # Whatever fails after the first tier is made (another tier's constructor, an
        # allocation, the rCache) releases the slabs and closes every tier made so far.
        if grad_offload is not None:
            grad_offload.close()
        for slab in allocated:
            slab.tier.release(slab)
        for tier in tiers.values():
            tier.close()
        raise
    return Allocation(tiers=tiers, cache=cache, grad_offload=grad_offload)


def _payloads(config: Config, groups: list[ChunkGroup]) -> dict[str, PayloadSpec]:
    """Group name -> what each of its chunks holds."""
    return {
        g.name: PayloadSpec(
            precision=config.precision,
            optimizer_states=config.optimizer_states,
            trainable=g.trainable,
        )
        for g in groups
    }


def payload_sizes(
    groups: list[ChunkGroup], plan: Plan, tiers: dict, payloads: dict[str, PayloadSpec]
) -> dict:
    """Tier name -> the byte sizes of the slabs ``allocate_payloads`` will allocate there."""
    sizes: dict[str, list[int]] = {}
    for group in groups:
        for chunk in group.chunks:
            slabs = payloads[group.name].slab_sizes(
                chunk.shard_size,
                home_tier=plan.param_tier_of(group.name, chunk.index),
                optim_tier=plan.optim_tier_of(group.name, chunk.index) if group.trainable else "",
                copies=lambda name: tiers[name].STATE_COPIES,  # [Note: atomic optimizer step]
                sharded=group.sharded,
                grads_in_device_home=group.grads_in_device_home,
                grads_in_nvme_home=group.grads_in_nvme_home,
                addressable=lambda name: tiers[name].ADDRESSABLE,
            )
            for tier, nbytes in slabs:
                sizes.setdefault(tier, []).append(nbytes)
    return sizes


_ALLOCATION_ORDER = (*OPTIM_STATES, "grad", "home")


def allocate_payloads(
    groups: list[ChunkGroup], plan: Plan, tiers: dict, payloads: dict[str, PayloadSpec]
) -> list:
    """Allocate every chunk's slabs (``payloads``: group name -> its ``PayloadSpec``); on
    failure release what was allocated."""
    for name, slab_bytes in payload_sizes(groups, plan, tiers, payloads).items():
        tiers[name].check_capacity(slab_bytes)  # before the first allocation
    allocated = []
    try:
        for group in groups:
            payload = payloads[group.name]
            for chunk in group.chunks:
                home = plan.param_tier_of(group.name, chunk.index)
                optim = plan.optim_tier_of(group.name, chunk.index) if group.trainable else home
                # fp32 with params and optimizer in one tier: the master is the home payload;
                # bf16/fp16: [Note: gradients in the parameter payload]
                in_home = payload.grads_in_home(
                    home,
                    optim,
                    sharded=group.sharded,
                    grads_in_device_home=group.grads_in_device_home,
                    grads_in_nvme_home=group.grads_in_nvme_home,
                    addressable=lambda name: tiers[name].ADDRESSABLE,
                )
                kinds = payload.kinds(
                    master_is_home=payload.home_is_master(home, optim), grads_in_home=in_home
                )
                slabs = {}
                for kind in sorted(kinds, key=_ALLOCATION_ORDER.index):
                    slabs[kind] = _allocate_slab(
                        payload,
                        kind,
                        chunk.shard_size,
                        tiers[home if kind == "home" else optim],
                        f"{group.name}#{chunk.index} {'params' if kind == 'home' else kind}",
                    )
                    allocated.append(slabs[kind])
                if in_home:  # [Note: gradients in the parameter payload]
                    slabs["grad"] = slabs["home"]
                if group.trainable:  # the gradient shard: [Note: active gradient offloading]
                    chunk.optim = OptimSlabs(
                        *(slabs[k] for k in (*OPTIM_STATES, "grad")),
                        tiers[optim],
                        grads_in_home=in_home,
                    )
                    chunk.optim.clear_grad()  # [Note: gradient memory between steps]
                chunk.home = slabs["home"] if "home" in slabs else chunk.optim.master
    except BaseException:
        for made in allocated:
            made.tier.release(made)
        for group in groups:
            for chunk in group.chunks:
                chunk.home = chunk.optim = None
        raise
    return allocated


def _allocate_slab(payload: PayloadSpec, kind: str, shard: int, tier: Tier, what: str):
    """The slab holding a ``shard``-element shard's ``kind`` on ``tier``."""
    numel, dtype = payload.stored(kind, shard)
    allocate = tier.allocate_state if payload.is_state(kind) else tier.allocate
    return allocate(numel, dtype, kind=payload.payload_kind(kind), what=what)


def release_payloads(groups: list[ChunkGroup]) -> None:
    """Give back every slab ``allocate_payloads`` allocated (a setup that failed part way)."""
    seen = set()
    for group in groups:
        for chunk in group.chunks:
            slabs = [chunk.home]
            if chunk.optim is not None:
                o = chunk.optim
                slabs += [o.master, o.exp_avg, o.exp_avg_sq, o.grad]
            for made in slabs:
                if made is not None and id(made) not in seen:
                    seen.add(id(made))
                    made.tier.release(made)
            chunk.home = chunk.optim = None


def reserve_storage_buffers(groups: list, plan, tiers: dict) -> None:
    """[Note: storage tiers' host buffers]
    A storage tier moves data through host buffers of its own (the NVMe tier's staged-read
    pool, its bounce buffers and its optimizer pipeline's pool). They are host memory like any slab, so setup
    reserves what each tier says they hold at most in the host tier, for the engine's life:
    ``host_memory`` counts them, and a budget without room for them fails here with the host
    tier's error, before the model is changed. The optimizer pipeline's buffers are fp32 copies
    of the largest shard (``OptimizerStep._make_pipelines``)."""
    shard = max((c.shard_size for g in groups for c in g.chunks), default=0)
    chunk = max((c.capacity for g in groups for c in g.chunks), default=0)
    for name, tier in sorted(tiers.items()):
        if tier.ADDRESSABLE:
            continue
        holds_states = any(
            plan.optim_tier_of(g.name, c.index) == name
            for g in groups
            if g.trainable
            for c in g.chunks
        )
        tier.size_host_buffers(transfer_bytes=chunk * 4)  # the widest payload: fp32
        nbytes = tier.host_buffer_bytes(optimizer_buffer_bytes=shard * 4 if holds_states else 0)
        if nbytes:
            tiers["host"].reserve(
                nbytes, kind=PayloadKind.STAGING, what=f"the {name} tier's staging buffers"
            )


def _make_tiers(
    host: PluginHost, config: Config, plan: Plan, needed: set[str], *, into: dict
) -> None:
    """Make the tiers the plan needs into ``into`` (the caller closes those made so far when
    one fails: [Note: a failed setup closes its tiers])."""
    classes = host.tier_classes()
    device = torch.device(config.device)
    budgets = {
        "device": plan.device_allowance
        if plan.device_allowance is not None
        else config.device_memory,
        "host": config.host_memory,
    }
    for name in sorted(needed | {"device", "host"}):
        if name not in classes:
            raise ConfigError(
                f"the plan puts data on the {name!r} tier, which no installed plugin provides"
                + (": install tierwise-nvme" if name == "nvme" else "")
            )
        into[name] = classes[name](device=device, budget=budgets.get(name), config=config)
