"""Assembling an engine for a model: setup's runtime work, in one place (``api.setup`` validates
the request and calls :func:`assemble_engine`).

Everything before ``fill_payloads`` only plans and allocates and is undone on failure
([Note: atomic setup]); from there on the model is changed.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import torch
import torch.distributed as dist

from tierwise.config import Config, ConfigError
from tierwise.devices import normalize_device
from tierwise.hardware import Hardware
from tierwise.hf_compat import enable_hf_checkpointing, hf_checkpointing_enabled
from tierwise.integrations.hf_save import install_save_pretrained
from tierwise.parallel.base import snapshot_model
from tierwise.plan import DEVICE_ACTIONS
from tierwise.planning.planner import may_recompute, profile_min_blocks
from tierwise.plugins import PluginHost
from tierwise.precision import compute_dtype
from tierwise.registry import engine_of, register
from tierwise.runtime.activations.pinned_pool import pinned_swap_bytes
from tierwise.runtime.activations.policy import find_blocks, resolve_policy
from tierwise.runtime.activations.policy import plan_action as planned_action
from tierwise.runtime.engine import Engine
from tierwise.runtime.grads.offload import gradient_offload_for
from tierwise.runtime.residency.rcache import RCache
from tierwise.runtime.setup.build import (
    allocate_payloads,
    check_chunk_size,
    collect_params,
    fill_from_weights,
    fill_payloads,
    io_buffer_bytes,
    layout_groups,
    move_buffers,
    release_payloads,
    static_profile,
)
from tierwise.runtime.setup.meta_buffers import compute_meta_buffers, install_buffers
from tierwise.tiers.base import PayloadKind
from tierwise.weights import open_weights


def assemble_engine(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    config: Config,
    *,
    host: PluginHost,
    decoupled: bool,
    process_group: dist.ProcessGroup | None,
    example_batch: Any,
    weights: Any = None,
) -> Engine:
    """Plan, allocate and build the engine managing ``model``; registers it
    (``tierwise.registry``). Nothing is changed on the model if it raises before the payloads
    are filled, or, with ``weights`` (a ``tierwise.weights`` source), while they are filled."""
    # [Note: normalised device]: tiers, engine and plugins all see the device as tensors report it
    config = dataclasses.replace(config, device=str(normalize_device(config.device)))
    world = _world_group(process_group)
    resolved = open_weights(weights).resolve(model) if weights is not None else None
    patterns = _patterns(config, host, world)
    restore_model = snapshot_model(model)  # [Note: atomic setup]
    try:
        for pattern in patterns:  # model-parallel patterns shard modules before anything is sized
            pattern.prepare(model)
        buffers = compute_meta_buffers(model)  # [Note: meta buffers]
        profile, hardware, plan, groups, tiers, cache, grad_offload, blocks = _plan_and_allocate(
            model, optimizer, config, host, patterns, example_batch
        )
    except BaseException:
        restore_model()
        raise
    dtype = compute_dtype(config.precision)
    if resolved is not None:  # [Note: loading pretrained weights]
        reserved = 0
        try:
            tiers["host"].reserve(
                plan.io_buffer_bytes,
                kind=PayloadKind.STAGING,
                what="the pretrained-weight load buffers (Plan.io_buffer_bytes)",
            )
            reserved = plan.io_buffer_bytes
            resolved.bind_slices(_claimed(model, patterns))
            fill_from_weights(groups, dtype, resolved)
        except BaseException:
            release_payloads(groups)
            cache.close()
            if grad_offload is not None:
                grad_offload.close()
            for tier in tiers.values():
                tier.close()
            restore_model()
            raise
        finally:
            tiers["host"].unreserve(reserved)
            resolved.close()
        _off_meta(model)
    del restore_model  # drops the originals of the parameters patterns sliced
    # --- from here on the model is changed -----------------------------------------------
    if resolved is None:
        fill_payloads(groups, dtype, model)
    install_buffers(buffers)
    if resolved is not None:
        resolved.load_buffers()
    move_buffers(model, tiers["device"].device)
    for group in groups:
        for chunk in group.chunks:
            chunk.attach_params(tiers["device"].device)
            for slot in chunk.slots:
                slot.param._tierwise_managed = True
    slots_by_param = {id(s.param): s for g in groups for c in g.chunks for s in c.slots}
    modules = {}
    for module in model.modules():
        own = [
            slots_by_param[id(p)]
            for p in module.parameters(recurse=False)
            if id(p) in slots_by_param
        ]
        if own:
            modules[module] = own
    engine = Engine(
        model=model,
        config=config,
        plan=plan,
        groups=groups,
        tiers=tiers,
        cache=cache,
        grad_offload=grad_offload,
        modules=modules,
        decoupled=decoupled,
        optimizer_groups=optimizer.param_groups,
        world_group=world,
        profile=profile,
        patterns=patterns,
        hardware=hardware,
        memory_tracer=host.memory_tracer,
        activation_blocks=blocks,
    )
    if not blocks and plan.activation_checkpointing:
        enable_hf_checkpointing(model)
    register(model, engine)
    model.zero_grad = types.MethodType(_zero_grad, model)  # Trainer calls model.zero_grad()
    install_save_pretrained(model)  # [Note: the dtype save_pretrained records]
    return engine


def _claimed(model: torch.nn.Module, patterns: list) -> list[tuple]:
    """(name, parameter, the pattern claiming it) for every distinct parameter."""
    return [
        (name, param, next(p for p in patterns if p.claims(name, param)))
        for name, param in model.named_parameters()
    ]


def _off_meta(model: torch.nn.Module) -> None:
    """Give parameters still on the meta device an empty CPU tensor (their values are in the
    chunks; ``attach_params`` makes each a view). ``set_data`` cannot leave the meta device."""
    for param in model.parameters():
        if param.is_meta:
            tags = dict(param.__dict__)  # swap_tensors swaps __dict__ too (shard specs)
            empty = torch.nn.Parameter(torch.empty(0, dtype=param.dtype), param.requires_grad)
            torch.utils.swap_tensors(param, empty)
            param.__dict__.update(tags)


def _zero_grad(model: torch.nn.Module, set_to_none: bool = True) -> None:
    """``model.zero_grad()`` on a managed model clears tierwise's gradient shards, as
    ``optimizer.zero_grad()`` does (parameters' ``.grad`` is always None)."""
    engine_of(model).zero_grad()


def _plan_and_allocate(model, optimizer, config: Config, host, patterns, example_batch):
    """Profile, plan, lay out and allocate for the prepared model; changes nothing on it (on
    failure, what was allocated is released)."""
    params = collect_params(model, optimizer, patterns)
    profile = host.profile_model(model=model, example_batch=example_batch, config=config)
    if profile is None:
        profile = static_profile(params)
    group_of = {m.name: m.group_name for m in params.values()}
    dp_size_of = {m.name: _dp_world(m.pattern)[1] for m in params.values()}
    for info in profile.params:
        info.group = group_of.get(info.name, info.group)
        info.dp_size = dp_size_of.get(info.name, info.dp_size)
    profile.module_params = profile.module_params or _module_params(model, params)
    hardware = Hardware(**host.probe_hardware(config=config))
    plan = host.make_plan(profile=profile, hardware=hardware, config=config)
    plan.check_tiers(host.tier_classes())
    # the plan is what runs: a planner may choose checkpointing, and Config's request stands
    plan.activation_checkpointing = plan.activation_checkpointing or config.activation_checkpointing
    check_chunk_size(plan)
    dtype = compute_dtype(config.precision)
    world_rank = {p.key: _dp_world(p) for p in patterns}
    groups = layout_groups(params, profile, plan, dtype, world_rank=world_rank)
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
    blocks = _activation_blocks(model, config, host, plan)
    _check_cache_minimum(model, config, profile, plan, groups)
    needed = {plan.param_tier_of(g.name, c.index) for g in groups for c in g.chunks}
    needed |= {plan.optim_tier_of(g.name, c.index) for g in groups if g.trainable for c in g.chunks}
    needed |= set(plan.activation_policy.values()) - set(DEVICE_ACTIONS)  # swaps name their tier
    tiers: dict = {}
    allocated: list = []
    grad_offload = None
    try:  # [Note: a failed setup closes its tiers]
        _make_tiers(host, config, plan, needed, into=tiers)
        allocated = allocate_payloads(
            groups,
            plan,
            tiers,
            fp32_alias=config.precision == "fp32",
            optimizer_states=config.optimizer_states,
        )
        pinned = pinned_swap_bytes(config, plan.activation_policy if blocks else {})
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
    return profile, hardware, plan, groups, tiers, cache, grad_offload, blocks


def _check_cache_minimum(model, config: Config, profile, plan, groups) -> None:
    """Refuse a plan with fewer rCache blocks than the step needs ([Note: the rCache
    minimum]), before anything is allocated."""
    chunk_of = {
        slot.name: chunk.key
        for g in groups
        for chunk in g.chunks
        for slot in chunk.slots
        if g.sharded or plan.param_tier_of(g.name, chunk.index) != "device"
    }
    recompute = (
        may_recompute(config)
        or plan.activation_checkpointing
        or hf_checkpointing_enabled(model)
        or "recompute" in plan.activation_policy.values()
    )
    minimum = profile_min_blocks(profile, chunk_of, recompute=recompute)
    if plan.cache_blocks < minimum:
        raise ConfigError(
            f"cache_blocks={plan.cache_blocks} is below this model's minimum of {minimum} rCache "
            f"blocks at chunk_size {plan.chunk_size} (the most chunks in use at one moment of a "
            f"step): set cache_blocks ≥ {minimum}, or leave it on 'auto'"
        )


def _activation_blocks(model, config: Config, host, plan) -> dict:
    """The model's transformer blocks; sets ``plan.activation_policy`` to the action each one
    gets (see ``tierwise.runtime.activations.policy.resolve_policy``). Raises before anything changes."""
    blocks = find_blocks(model)
    if not blocks:
        if config.activation_policy or config.activation_offload in ("host", "nvme"):
            raise ConfigError(
                "activation_policy / activation_offload need transformer blocks, and this model "
                "has none tierwise recognises (no _no_split_modules classes, no nn.ModuleList of "
                "layers); use activation_checkpointing or leave activations on 'none'"
            )
        return blocks
    hf_checkpointing = hf_checkpointing_enabled(model)
    try:
        policy = resolve_policy(
            list(blocks),
            policy=config.activation_policy,
            offload=config.activation_offload,
            checkpointing=plan.activation_checkpointing or hf_checkpointing,
            plan_policy=plan.activation_policy,
        )
    except ValueError as err:
        raise ConfigError(str(err)) from None
    on_nvme = [b for b, a in policy.items() if a == "nvme"]
    if on_nvme and "nvme" not in host.tier_classes():
        raise ConfigError(
            f"the activation policy swaps {len(on_nvme)} block(s) ({on_nvme[0]}, ...) to nvme, "
            "which needs the tierwise-nvme plugin: pip install tierwise-nvme (and set nvme_path)"
        )
    planned = {b: planned_action(b, plan.activation_policy) for b in blocks}
    for block, action in policy.items():
        if action != planned[block]:  # the planner's reason for this block no longer holds
            plan.reasons = [r for r in plan.reasons if not r.startswith(f"activations of {block}:")]
            plan.reasons.append(f"activations of {block}: {action} (as Config asked)")
    plan.activation_policy = policy
    return blocks


def _module_params(model: torch.nn.Module, params) -> dict[str, list[str]]:
    name_of = {id(m.param): m.name for m in params.values()}
    out = {}
    for mod_name, module in model.named_modules():
        names = [name_of[id(p)] for p in module.parameters(recurse=False) if id(p) in name_of]
        if names:
            out[mod_name] = names
    return out


def _world_group(process_group) -> dist.ProcessGroup | None:
    if process_group is not None:
        return process_group
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def _patterns(config: Config, host, world) -> list:
    classes = host.pattern_classes()
    patterns = []
    for name, size in (config.parallel or {}).items():
        if name not in classes:
            raise ConfigError(
                f"Config.parallel names pattern {name!r}, which no installed plugin provides; "
                f"available: {', '.join(sorted(classes))} (tierwise-moe adds 'expert' and 'tensor')"
            )
        patterns.append(classes[name](size=size, config=config, process_group=world))
    patterns.append(classes["data"](size=1, config=config, process_group=world))
    return patterns


def _dp_world(pattern) -> tuple[Any, int, int]:
    pg = pattern.dp_group()
    if pg is None or not dist.is_initialized():
        return None, 1, 0
    return pg, dist.get_world_size(pg), dist.get_rank(pg)


def reserve_storage_buffers(groups: list, plan, tiers: dict) -> None:
    """[Note: storage tiers' host buffers]
    A storage tier moves data through host buffers of its own (the NVMe tier's staged-read
    pool and its optimizer pipeline's pool). They are host memory like any slab, so setup
    reserves what each tier says they hold at most in the host tier, for the engine's life:
    ``host_memory`` counts them, and a budget without room for them fails here with the host
    tier's error, before the model is changed. The optimizer pipeline's buffers are fp32 copies
    of the largest shard (``OptimizerStep._make_pipelines``)."""
    shard = max((c.shard_size for g in groups for c in g.chunks), default=0)
    for name, tier in sorted(tiers.items()):
        if tier.ADDRESSABLE:
            continue
        holds_states = any(
            plan.optim_tier_of(g.name, c.index) == name
            for g in groups
            if g.trainable
            for c in g.chunks
        )
        nbytes = tier.host_buffer_bytes(optimizer_buffer_bytes=shard * 4 if holds_states else 0)
        if nbytes:
            tiers["host"].reserve(
                nbytes, kind=PayloadKind.STAGING, what=f"the {name} tier's staging buffers"
            )


def _make_tiers(host, config: Config, plan, needed: set[str], *, into: dict) -> None:
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
