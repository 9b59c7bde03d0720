"""Forward seconds per layer on the compute device: the cost model's compute term.

Measured where the profiler timed the layer (``Profile.layer_forward_s``: tierwise-profiler runs
each distinct forward op once for real, see its [Note: layer timing]); otherwise the layer's
forward FLOPs over ``Hardware.device_flops`` (probed or a preset). The peak matmul rate is an optimistic bound (a CPU
runs a small model's step several times slower than FLOPs / peak say), so a measured time wins
whenever there is one. One training step computes the forward once and the backward, about
``BACKWARD_OVER_FORWARD`` times the forward (two matrix products per forward one), plus the
forward of every recomputed layer again.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierwise.profile import Profile

BACKWARD_OVER_FORWARD = 2.0
"""Backward time over forward time of a layer (dX and dW: two products per forward one)."""


@dataclass(frozen=True)
class LayerTimes:
    """Forward seconds of the whole model and of each profiled layer."""

    forward_s: float
    """One forward pass, seconds."""
    layers: dict[str, float]
    """Layer (module name, as in ``Profile.layer_flops``) -> forward seconds."""
    source: str
    """Where the figures come from, for ``Plan.reasons``."""

    @property
    def step_s(self) -> float:
        """Forward plus backward of one step, without recomputation."""
        return (1 + BACKWARD_OVER_FORWARD) * self.forward_s


def layer_times(profile: Profile, device_flops: float) -> LayerTimes:
    """Measured forward times where there are some, else FLOPs / ``device_flops``."""
    measured = profile.layer_forward_s
    layers = {
        layer: measured[layer] if layer in measured else flops / device_flops
        for layer, flops in profile.layer_flops.items()
    }
    layers.update(measured)
    if measured:
        source = (
            f"compute: forward {sum(layers.values()) * 1e3:.4g} ms measured per layer by the "
            f"profiler, backward {BACKWARD_OVER_FORWARD:g} x forward"
        )
        return LayerTimes(sum(layers.values()), layers, source)
    if layers:
        source = (
            "compute: forward FLOPs / hardware.device_flops (the profile has no measured layer "
            "times; an optimistic bound, real steps are slower)"
        )
        return LayerTimes(sum(layers.values()), layers, source)
    if profile.batch_size and profile.seq_len:
        tokens = profile.batch_size * profile.seq_len
        flops = 2.0 * profile.total_numel * tokens
        source = (
            f"compute: profile has no layer FLOPs: forward taken as 2 x parameters x {tokens} "
            "tokens FLOPs / hardware.device_flops"
        )
        return LayerTimes(flops / device_flops, {}, source)
    return LayerTimes(
        0.0, {}, "compute: profile has neither layer FLOPs nor batch shape: taken as 0"
    )


__all__ = ["BACKWARD_OVER_FORWARD", "LayerTimes", "layer_times"]
