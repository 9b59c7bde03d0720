"""Activation policy (LoHan's traffic-aware activation swapping), per layer.

A layer's saved activations are kept on the device, recomputed in backward, or swapped to host
or NVMe. Layers that are not kept are ordered by offloading benefit, forward FLOPs (here: the
layer's forward seconds, measured or FLOPs / FLOP/s, see ``tierwise_search.compute``) per saved
byte: swapping a layer with much compute per byte saves the most recomputation per byte moved.
The first ``x`` layers in that order are swapped and the rest recomputed; ``x`` is the one that
minimises the predicted step time (compute grows as x falls, link time as x grows; the maximum
of the two is convex in x, LoHan section 4). Swapped and recomputed layers free the same device
memory, so the choice of ``x`` does not change the model-data placement.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tierwise.profile import Profile

from tierwise_search.cost import ActivationTraffic, Prediction


@dataclass(frozen=True)
class ActivationChoice:
    """Which layers leave the device, and where swapped ones go."""

    name: str
    """"keep", "checkpointing", "swap to host", "swap to nvme"."""
    leaving: tuple[str, ...]
    """Layers not kept, by offloading benefit (forward seconds per byte), highest first."""
    target: str | None
    """"host" or "nvme" for swaps; None: every leaving layer is recomputed."""
    device_bytes: int
    """Peak activation bytes on the device under this choice (before F_frag)."""
    host_reserve: int
    """Host bytes reserved for swapped activations (all leaving layers, an upper bound)."""


def block_layers(profile: Profile) -> list[str]:
    """Layers that are activation-checkpoint blocks (every parameter of a block under it)."""
    layers = []
    for layer in profile.layer_activation_bytes:
        prefix = layer + "."
        if any(
            block and all(n.startswith(prefix) for n in block)
            for block in profile.checkpoint_blocks
        ):
            layers.append(layer)
    return layers


def _by_benefit(profile: Profile, layers: list[str], seconds: dict[str, float]) -> tuple[str, ...]:
    def benefit(layer: str) -> float:
        nbytes = profile.layer_activation_bytes.get(layer, 0)
        return seconds.get(layer, 0.0) / nbytes if nbytes else 0.0

    return tuple(sorted(layers, key=lambda layer: (-benefit(layer), layer)))


def _choice(
    profile: Profile, seconds: dict[str, float], name: str, leaving: list[str], target: str | None
) -> ActivationChoice:
    sizes = profile.layer_activation_bytes
    freed = sum(sizes[layer] for layer in leaving)
    working = max((sizes[layer] for layer in leaving), default=0)  # one layer at a time
    device = max(profile.peak_activation_bytes - freed, 0) + working
    reserve = freed if target == "host" else 0
    return ActivationChoice(name, _by_benefit(profile, leaving, seconds), target, device, reserve)


def activation_choices(
    profile: Profile, seconds: dict[str, float], *, offload: str, checkpointing: bool, nvme: bool
):
    """Candidate choices for Config.activation_offload ("none" | "host" | "nvme" | "auto");
    ``seconds``: forward seconds per layer."""
    layers = [layer for layer, nbytes in profile.layer_activation_bytes.items() if nbytes > 0]
    if checkpointing:
        base = _choice(profile, seconds, "checkpointing", block_layers(profile), None)
    else:
        base = _choice(profile, seconds, "keep", [], None)
    if offload == "none" or not layers:
        return [base]
    if offload in ("host", "nvme"):
        return [_choice(profile, seconds, f"swap to {offload}", layers, offload)]
    choices = [base, _choice(profile, seconds, "swap to host", layers, "host")]
    if nvme:
        choices.append(_choice(profile, seconds, "swap to nvme", layers, "nvme"))
    return choices


def traffic_for(
    profile: Profile,
    seconds: dict[str, float],
    swapped: tuple[str, ...],
    recomputed: tuple[str, ...],
    target: str | None,
) -> ActivationTraffic:
    sizes = profile.layer_activation_bytes
    moved = float(sum(sizes[layer] for layer in swapped))
    return ActivationTraffic(
        recompute_s=float(sum(seconds.get(layer, 0.0) for layer in recomputed)),
        d2h=moved,
        h2d=moved,
        nvme_read=moved if target == "nvme" else 0.0,
        nvme_write=moved if target == "nvme" else 0.0,
        host_bytes=int(moved) if target == "host" else 0,
    )


def best_split(
    profile: Profile,
    seconds: dict[str, float],
    choice: ActivationChoice,
    evaluate: Callable[[ActivationTraffic], Prediction],
) -> tuple[dict[str, str], ActivationTraffic, Prediction]:
    """The per-layer policy minimising the predicted step under ``choice``."""
    order = choice.leaving
    counts = range(len(order) + 1) if choice.target else [0]
    best = None
    for swapped_count in counts:
        swapped, recomputed = order[:swapped_count], order[swapped_count:]
        traffic = traffic_for(profile, seconds, swapped, recomputed, choice.target)
        prediction = evaluate(traffic)
        if best is None or prediction.total < best[2].total:
            best = (swapped_count, traffic, prediction)
    swapped_count, traffic, prediction = best
    policy = {layer: "keep" for layer in profile.layer_activation_bytes}
    for index, layer in enumerate(order):
        policy[layer] = choice.target if index < swapped_count else "recompute"
    return policy, traffic, prediction


__all__ = [
    "ActivationChoice",
    "activation_choices",
    "best_split",
    "block_layers",
    "traffic_for",
]
