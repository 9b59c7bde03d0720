"""The public entry points: setup, engine_of, clip_grad_norm_, no_sync."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from tierwise import registry
from tierwise.checkpoint.full_state import install_state_dict_hooks
from tierwise.config import Config
from tierwise.integrations.hf_save import install_save_pretrained
from tierwise.optim import check_optimizer
from tierwise.optimizer import TierwiseOptimizer
from tierwise.plugins import get_plugin_host
from tierwise.runtime.setup.pipeline import assemble_engine

if TYPE_CHECKING:
    from tierwise.runtime.engine import Engine


def setup(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    config: Config | dict | str | os.PathLike | None = None,
    *,
    process_group: dist.ProcessGroup | None = None,
    example_batch: Any = None,
    weights: Any = None,
    **overrides,
) -> tuple[torch.nn.Module, TierwiseOptimizer]:
    """Move ``model``'s data into chunks across tiers; return it and a chunked optimizer.

    The model is the same object (its parameters become views into chunks). The optimizer keeps
    your ``param_groups``. Nothing is changed on the model if setup raises.

    ``weights``: pretrained values for the parameters, read straight into the chunks on their
    tiers one tensor at a time (the model may be on the meta device; it is never materialised):
    a safetensors checkpoint directory (``save_pretrained`` output, sharded or not) or file, a
    callable ``name -> tensor`` or a state dict. Hugging Face's legacy layouts are converted as
    ``from_pretrained`` converts them; tied parameters need one of their names. A missing,
    unexpected or mis-shaped tensor, or a truncated file, raises ``tierwise.weights.WeightsError``
    naming it, and leaves nothing behind ([Note: loading pretrained weights]).
    """
    if registry.managed(model):
        raise ValueError(
            "tierwise.setup: this model is already managed by tierwise; call setup once per model"
        )
    config = Config.from_any(config, **overrides)
    decoupled = check_optimizer(optimizer)
    engine = assemble_engine(
        model,
        optimizer,
        config,
        host=get_plugin_host(),
        decoupled=decoupled,
        process_group=process_group,
        example_batch=example_batch,
        weights=weights,
    )
    # the entry layer's own parts of a managed model (the engine is built and registered)
    install_state_dict_hooks(engine, model, engine.patterns)
    install_save_pretrained(model)  # [Note: the dtype save_pretrained records]
    return model, TierwiseOptimizer(engine, optimizer)


def engine_of(model: torch.nn.Module) -> Engine:
    """The engine managing ``model`` (``.plan``, ``.stats()``)."""
    return cast("Engine", registry.engine_of(model))


def clip_grad_norm_(
    model: torch.nn.Module, max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """Clip the global gradient norm over all chunks (and ranks); return the total norm."""
    return engine_of(model).optimizer.clip_grad_norm(float(max_norm), norm_type)


@contextmanager
def no_sync(model: torch.nn.Module):
    """Accumulate gradients without communication (like DDP's ``no_sync``)."""
    with engine_of(model).no_sync():
        yield
