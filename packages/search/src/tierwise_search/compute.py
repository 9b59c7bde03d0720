"""Forward seconds per layer on the compute device: the cost model's compute term.

[Note: achievable compute] Three sources, best first:
1. measured: ``Profile.layer_forward_s``, the profiler ran each distinct forward op on the
   compute device (its [Note: layer timing]); what this machine really does. The backward is
   measured too when the profile has ``layer_backward_s`` (the profiler's [Note: backward
   timing]); the ratios below price it otherwise.
2. op classes: ``Profile.layer_ops`` lists each layer's forward ops as matmuls, fused attention
   and memory-bound ops (element-wise, norms, softmax, copies) with their FLOPs and bytes. An
   op's time is its roofline at what the device achieves, not at its datasheet peak:
   ``max(flops / (device_flops x matmul_efficiency), bytes / device_memory_bandwidth)`` for
   matmuls and attention (a small or thin matmul is bound by its bytes), ``bytes /
   device_memory_bandwidth`` for the rest. ``matmul_efficiency`` is a published measurement
   that each GPU preset cites (Megatron-LM's 52 % on A100s, Llama 3's 43 % on H100s), so the
   predicted utilisation never exceeds what the preset documents as achievable.
3. FLOPs only (a profile without ops): ``flops / (device_flops x matmul_efficiency)``.

One training step computes the forward once, the backward, and the forward of every recomputed
block again: a recomputed block costs its forward time, whichever source gave it. The backward
of a matmul or attention op is ``BACKWARD_OVER_FORWARD`` times its forward (two products per
forward one: dX and dW); that of a memory-bound op ``MEMORY_BACKWARD_OVER_FORWARD`` times (it
reads its input and the incoming gradient and writes one gradient: three tensors where the
forward moved two). Measured profiles say which of a layer's seconds were matmuls
(``Profile.layer_matmul_s``); without that split the whole layer counts as matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tierwise.profile import Profile

BACKWARD_OVER_FORWARD = 2.0
"""Backward time over forward time of a matmul (dX and dW: two products per forward one)."""
MEMORY_BACKWARD_OVER_FORWARD = 1.5
"""Backward time over forward time of a memory-bound op (three tensors moved per two)."""
OP_CLASSES = ("matmul", "attention", "memory")
"""The classes of ``Profile.layer_ops``."""


@dataclass(frozen=True)
class ComputeRates:
    """What the device achieves (``tierwise_search.rates.Rates`` carries them)."""

    flops: float
    """Datasheet (or probed) FLOP/s."""
    matmul_efficiency: float
    """The largest fraction of ``flops`` matmuls reach."""
    memory_bandwidth: float
    """Bytes/s memory-bound ops reach."""

    @property
    def matmul_flops(self) -> float:
        return self.flops * self.matmul_efficiency


def op_seconds(kind: str, flops: float, nbytes: float, rates: ComputeRates) -> float:
    """One op's forward seconds (see [Note: achievable compute])."""
    memory_s = nbytes / rates.memory_bandwidth
    if kind == "memory":
        return memory_s
    return max(flops / rates.matmul_flops, memory_s)


@dataclass(frozen=True)
class LayerTimes:
    """Forward seconds of the whole model and of each profiled layer."""

    forward_s: float
    """One forward pass, seconds."""
    layers: dict[str, float]
    """Layer (module name, as in ``Profile.layer_flops``) -> forward seconds."""
    source: str
    """Where the figures come from, for ``Plan.reasons``."""
    by_class: dict[str, float] = field(default_factory=dict)
    """Forward seconds per op class, when op classes gave them."""
    backward_s: float | None = None
    """One backward pass (without recomputation), seconds; None: ``BACKWARD_OVER_FORWARD`` x
    the forward."""

    @property
    def backward(self) -> float:
        if self.backward_s is None:
            return BACKWARD_OVER_FORWARD * self.forward_s
        return self.backward_s

    @property
    def step_s(self) -> float:
        """Forward plus backward of one step, without recomputation."""
        return self.forward_s + self.backward


def layer_times(profile: Profile, rates: ComputeRates) -> LayerTimes:
    """Forward seconds per layer from the best source the profile allows."""
    measured = profile.layer_forward_s
    if measured:
        layers = {
            layer: flops / rates.matmul_flops
            for layer, flops in profile.layer_flops.items()
            if layer not in measured
        }
        layers.update(measured)
        matmul = {layer: profile.layer_matmul_s.get(layer, s) for layer, s in layers.items()}
        backward = sum(
            BACKWARD_OVER_FORWARD * matmul[layer]
            + MEMORY_BACKWARD_OVER_FORWARD * max(seconds - matmul[layer], 0.0)
            for layer, seconds in layers.items()
        )
        forward = sum(layers.values())
        how = f"{BACKWARD_OVER_FORWARD:g} x matmuls, {MEMORY_BACKWARD_OVER_FORWARD:g} x the rest"
        if profile.layer_backward_s:  # measured too: profiler's [Note: backward timing]
            backward = sum(
                profile.layer_backward_s.get(
                    layer,
                    BACKWARD_OVER_FORWARD * matmul[layer]
                    + MEMORY_BACKWARD_OVER_FORWARD * max(seconds - matmul[layer], 0.0),
                )
                for layer, seconds in layers.items()
            )
            how = "measured per layer"
        source = (
            f"compute: forward {forward * 1e3:.4g} ms measured per layer by the profiler "
            f"({sum(matmul.values()) * 1e3:.4g} ms of it matmuls), backward {backward * 1e3:.4g} "
            f"ms ({how})"
        )
        return LayerTimes(forward, layers, source, backward_s=backward)
    ceiling = (
        f"{rates.matmul_efficiency:.0%} of {rates.flops / 1e12:.4g} TFLOP/s (matmul_efficiency)"
    )
    if profile.layer_ops:
        layers, by_class = {}, dict.fromkeys(OP_CLASSES, 0.0)
        for layer, ops in profile.layer_ops.items():
            seconds = 0.0
            for kind, entries in ops.items():
                for flops, nbytes, count in entries:
                    op_s = count * op_seconds(kind, flops, nbytes, rates)
                    by_class[kind] = by_class.get(kind, 0.0) + op_s
                    seconds += op_s
            layers[layer] = seconds
        for layer, flops in profile.layer_flops.items():  # a layer the op log missed
            layers.setdefault(layer, flops / rates.matmul_flops)
        parts = ", ".join(f"{kind} {s * 1e3:.4g} ms" for kind, s in by_class.items() if s)
        forward = sum(layers.values())
        backward = BACKWARD_OVER_FORWARD * forward - (
            BACKWARD_OVER_FORWARD - MEMORY_BACKWARD_OVER_FORWARD
        ) * by_class.get("memory", 0.0)
        source = (
            f"compute: forward {forward * 1e3:.4g} ms by op class ({parts}): "
            f"matmuls at {ceiling} or their bytes at {rates.memory_bandwidth / 1e9:.4g} GB/s, "
            f"memory-bound ops at that bandwidth; backward {backward * 1e3:.4g} ms "
            f"({BACKWARD_OVER_FORWARD:g} x matmuls, {MEMORY_BACKWARD_OVER_FORWARD:g} x the rest)"
        )
        return LayerTimes(forward, layers, source, by_class, backward)
    if profile.layer_flops:
        layers = {layer: f / rates.matmul_flops for layer, f in profile.layer_flops.items()}
        source = f"compute: forward FLOPs at {ceiling} (the profile has no op classes)"
        return LayerTimes(sum(layers.values()), layers, source)
    if profile.batch_size and profile.seq_len:
        tokens = profile.batch_size * profile.seq_len
        flops = 2.0 * profile.total_numel * tokens
        source = (
            f"compute: profile has no layer FLOPs: forward taken as 2 x parameters x {tokens} "
            f"tokens FLOPs at {ceiling}"
        )
        return LayerTimes(flops / rates.matmul_flops, {}, source)
    return LayerTimes(
        0.0, {}, "compute: profile has neither layer FLOPs nor batch shape: taken as 0"
    )


def block_seconds(seconds: dict[str, float], block: str) -> float:
    """Forward seconds of a block: every layer inside it (``block`` or ``block.*``)."""
    prefix = block + "."
    return sum(s for layer, s in seconds.items() if layer == block or layer.startswith(prefix))


__all__ = [
    "BACKWARD_OVER_FORWARD",
    "MEMORY_BACKWARD_OVER_FORWARD",
    "OP_CLASSES",
    "ComputeRates",
    "LayerTimes",
    "block_seconds",
    "layer_times",
    "op_seconds",
]
