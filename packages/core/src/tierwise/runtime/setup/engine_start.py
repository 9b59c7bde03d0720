"""Setup stage 8, engine: the ``Engine`` over the bound model (it builds its components and
installs its hooks), registered for ``tierwise.engine_of``."""

from __future__ import annotations

import types
from typing import Any

import torch

from tierwise.chunks import ChunkGroup, ParamSlot
from tierwise.config import Config
from tierwise.hf_compat import enable_hf_checkpointing
from tierwise.plugins import PluginHost
from tierwise.registry import engine_of, register
from tierwise.runtime.engine import Engine
from tierwise.runtime.setup.allocation import Allocation
from tierwise.runtime.setup.patterns import Patterns
from tierwise.runtime.setup.planning import Planned
from tierwise.runtime.setup.profiling import Profiled


def start_engine(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    config: Config,
    *,
    host: PluginHost,
    decoupled: bool,
    world: Any,
    patterns: Patterns,
    profiled: Profiled,
    planned: Planned,
    groups: list[ChunkGroup],
    allocation: Allocation,
    modules: dict[torch.nn.Module, list[ParamSlot]],
) -> Engine:
    """Build the engine managing ``model`` and register it."""
    engine = Engine(
        model=model,
        config=config,
        plan=planned.plan,
        groups=groups,
        tiers=allocation.tiers,
        cache=allocation.cache,
        grad_offload=allocation.grad_offload,
        modules=modules,
        decoupled=decoupled,
        optimizer_groups=optimizer.param_groups,
        world_group=world,
        profile=profiled.profile,
        patterns=patterns.patterns,
        hardware=planned.hardware,
        memory_tracer=host.memory_tracer,
        activation_blocks=planned.blocks,
    )
    if not planned.blocks and planned.plan.activation_checkpointing:
        enable_hf_checkpointing(model)
    register(model, engine)
    model.zero_grad = types.MethodType(_zero_grad, model)  # Trainer calls model.zero_grad()
    return engine


def _zero_grad(model: torch.nn.Module, set_to_none: bool = True) -> None:
    """``model.zero_grad()`` on a managed model clears tierwise's gradient shards, as
    ``optimizer.zero_grad()`` does (parameters' ``.grad`` is always None)."""
    engine_of(model).zero_grad()
