"""Setup stage 3, plan: the hardware, the plan (a planner plugin's, ``tierwise_make_plan``, or
core's default planner) checked against the installed tiers, and the action each transformer
block's activations get."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from tierwise.config import Config, ConfigError
from tierwise.hardware import Hardware
from tierwise.hf_compat import hf_checkpointing_enabled
from tierwise.plan import Plan, swap_target
from tierwise.planning.host_minimum import plan_for_weight_load
from tierwise.plugins import PluginHost
from tierwise.precision import PARAM_BYTES
from tierwise.runtime.activations.policy import find_blocks, resolve_policy
from tierwise.runtime.activations.policy import plan_action as planned_action
from tierwise.runtime.setup.profiling import Profiled

MIN_CHUNK_SIZE = 1024
"""Smallest chunk (elements) tierwise accepts: below it per-chunk bookkeeping dominates."""


@dataclass(frozen=True, kw_only=True)
class Planned:
    """What the plan stage decided."""

    plan: Plan
    """The plan that runs (the layout stage records its chunk groups in it)."""
    hardware: Hardware
    """What the hardware probe found."""
    blocks: dict
    """The model's transformer blocks (name -> module; empty when it has none)."""
    hf_checkpointing: bool
    """The model has Hugging Face gradient checkpointing switched on (it recomputes)."""


def make_plan(
    model: torch.nn.Module,
    config: Config,
    *,
    host: PluginHost,
    profiled: Profiled,
    loads_weights: bool = False,
) -> Planned:
    """Probe the hardware and plan for the profiled model; raises before anything changes.
    ``loads_weights``: pretrained weights load into the chunks, so the plan must leave room
    for the load buffers; with ``Config.saves_weights`` for the save buffers ([Note: the weight
    load checked at plan time])."""
    hardware = Hardware(**host.probe_hardware(config=config))
    profile = profiled.profile

    def plan_at(budget: int | None) -> Plan:
        changed = dataclasses.replace(config, host_memory=budget)
        return host.make_plan(profile=profile, hardware=hardware, config=changed)

    if loads_weights or config.saves_weights:
        plan = plan_for_weight_load(
            plan_at,
            config.host_memory,
            largest_numel=max((p.numel for p in profile.params), default=0),
            itemsize=PARAM_BYTES[config.precision],
            ranks_per_node=hardware.ranks_per_node,  # [Note: a rank's host share]
            loads=loads_weights,
            saves=config.saves_weights,
        )
    else:
        plan = host.make_plan(profile=profile, hardware=hardware, config=config)
    plan.check_tiers(host.tier_classes())
    # the plan is what runs: a planner may choose checkpointing, and Config's request stands
    plan.activation_checkpointing = plan.activation_checkpointing or config.activation_checkpointing
    check_chunk_size(plan)
    hf_checkpointing = hf_checkpointing_enabled(model)
    blocks = _activation_blocks(model, config, host, plan, hf_checkpointing)
    return Planned(plan=plan, hardware=hardware, blocks=blocks, hf_checkpointing=hf_checkpointing)


def check_chunk_size(plan: Plan) -> None:
    if plan.chunk_size < MIN_CHUNK_SIZE:
        raise ValueError(
            f"chunk_size {plan.chunk_size} is below the minimum of {MIN_CHUNK_SIZE} elements "
            f"(per-chunk bookkeeping would dominate): use chunk_size ≥ {MIN_CHUNK_SIZE} or 'auto'"
        )


def _activation_blocks(
    model, config: Config, host: PluginHost, plan: Plan, hf_checkpointing: bool
) -> dict:
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
    on_nvme = [b for b, a in policy.items() if swap_target(a) == "nvme"]
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
