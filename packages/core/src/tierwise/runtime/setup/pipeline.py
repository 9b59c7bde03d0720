"""Assembling an engine for a model: setup's runtime work as a list of stages (``api.setup``
validates the request, calls :func:`assemble_engine`, then installs the entry layer's parts).

Each stage is one module of this package that takes what the stages before it produced and
returns what the next ones need: patterns → profile → plan → layout → allocation → values →
bindings → engine. Up to the allocation nothing on the model changes and a failure undoes
what was done ([Note: atomic setup]); pretrained weights are written into the chunks before the
model changes too ([Note: loading pretrained weights]); from the values on the model is changed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from tierwise.config import Config
from tierwise.devices import normalize_device
from tierwise.parallel.base import snapshot_model
from tierwise.plugins import PluginHost
from tierwise.precision import compute_dtype
from tierwise.runtime.engine import Engine
from tierwise.runtime.setup.allocation import allocate
from tierwise.runtime.setup.bindings import bind_params
from tierwise.runtime.setup.chunk_layout import lay_out
from tierwise.runtime.setup.engine_start import start_engine
from tierwise.runtime.setup.meta_buffers import compute_meta_buffers
from tierwise.runtime.setup.patterns import make_patterns, prepare_model, world_group
from tierwise.runtime.setup.planning import make_plan
from tierwise.runtime.setup.profiling import profile_model
from tierwise.runtime.setup.values import write_values
from tierwise.runtime.setup.weight_fill import load_pretrained
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
    world = world_group(process_group)
    # a meta model's values come from the RNG as the caller left it, whatever profiling drew
    # (a cached profile draws nothing): [Note: initialising a meta model]
    init_rng = torch.random.get_rng_state()
    resolved = open_weights(weights).resolve(model) if weights is not None else None
    pattern_list = make_patterns(config, host, world)
    restore_model = snapshot_model(model)  # [Note: atomic setup]
    try:
        # model-parallel patterns shard modules before anything is sized
        patterns = prepare_model(model, pattern_list)
        buffers = compute_meta_buffers(model)  # [Note: meta buffers]
        profiled = profile_model(
            model, optimizer, config, host=host, patterns=patterns, example_batch=example_batch
        )
        planned = make_plan(
            model, config, host=host, profiled=profiled, loads_weights=resolved is not None
        )
        groups = lay_out(config, patterns=patterns, profiled=profiled, planned=planned)
        allocation = allocate(config, host=host, planned=planned, groups=groups)
    except BaseException:
        restore_model()
        raise
    dtype = compute_dtype(config.precision)
    if resolved is not None:  # [Note: loading pretrained weights]
        try:
            load_pretrained(
                resolved,
                claimed=_claimed(model, patterns.patterns),
                groups=groups,
                dtype=dtype,
                host_tier=allocation.tiers["host"],
                io_buffer_bytes=planned.plan.io_buffer_bytes,
            )
        except BaseException:
            allocation.release(groups)
            restore_model()
            raise
    del restore_model  # drops the originals of the parameters patterns sliced
    # --- from here on the model is changed -----------------------------------------------
    device = allocation.tiers["device"].device
    torch.random.set_rng_state(init_rng)
    write_values(
        model, groups=groups, dtype=dtype, buffers=buffers, weights=resolved, device=device
    )
    modules = bind_params(model, groups, device)
    return start_engine(
        model,
        optimizer,
        config,
        host=host,
        decoupled=decoupled,
        world=world,
        patterns=patterns,
        profiled=profiled,
        planned=planned,
        groups=groups,
        allocation=allocation,
        modules=modules,
    )


def _claimed(model: torch.nn.Module, patterns: list) -> list[tuple]:
    """(name, parameter, the pattern claiming it) for every distinct parameter."""
    return [
        (name, param, next(p for p in patterns if p.claims(name, param)))
        for name, param in model.named_parameters()
    ]
