"""tierwise-profiler: pre-runtime model profile, hardware probe, runtime memory tracer.

Hooks:
- ``tierwise_profile_model``: one training step on fake tensors (no model memory) when the engine
  passes an example batch; None when it does not (a batch's shape decides activation memory and
  guessing one would mislead the planner, so the engine's warm-up trace of the first real batch
  is better) and None, with a ``ProfilerFallbackWarning`` naming the op, when the model's forward
  needs tensor values.
- ``tierwise_probe_hardware``: bandwidths and velocities, measured once per machine and cached.
- ``tierwise_memory_tracer``: a :class:`StepMemoryTracer` the engine drives during its warm-up step.
- ``tierwise_add_cli_commands``: ``tierwise profile`` and ``tierwise probe``.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from tierwise.hookspecs import hookimpl

from tierwise_profiler._version import __version__
from tierwise_profiler.tracer import StepMemoryTracer

if TYPE_CHECKING:
    import torch
    from tierwise.config import Config
    from tierwise.profile import Profile


class ProfilerFallbackWarning(UserWarning):
    """The pre-runtime profile could not run; the engine falls back to its warm-up trace."""


@hookimpl
def tierwise_profile_model(
    model: torch.nn.Module, example_batch: Any, config: Config
) -> Profile | None:
    if example_batch is None:
        return None
    from tierwise_profiler.model_profile import MetaProfileError, profile_model

    try:
        return profile_model(
            model,
            example_batch,
            precision=config.precision,
            device=config.device,
            # the runtime recomputes blocks under checkpointing unless every block is swapped
            # (tierwise.runtime.activations.policy.resolve_policy): profile the step it runs
            activation_checkpointing=config.activation_checkpointing
            and config.activation_offload not in ("host", "nvme"),
            time_layers=True,
        )
    except MetaProfileError as err:
        warnings.warn(f"tierwise-profiler: {err}", ProfilerFallbackWarning, stacklevel=2)
        return None


@hookimpl
def tierwise_probe_hardware(config: Config) -> dict[str, Any] | None:
    from tierwise.probe import device_present

    from tierwise_profiler.hardware_probe import probe

    if not device_present(config.device):  # nothing to measure (and no CUDA call to make)
        return None
    return dict(probe(config.device, config.precision)["hardware"])


@hookimpl
def tierwise_memory_tracer(device: torch.device, model_bytes) -> StepMemoryTracer:
    return StepMemoryTracer(device, model_bytes=model_bytes)


@hookimpl
def tierwise_add_cli_commands(subparsers) -> None:
    from tierwise_profiler.cli import add_commands

    add_commands(subparsers)


__all__ = [
    "StepMemoryTracer",
    "ProfilerFallbackWarning",
    "__version__",
    "tierwise_add_cli_commands",
    "tierwise_probe_hardware",
    "tierwise_profile_model",
]
