"""Activation policy (LoHan's traffic-aware activation swapping), per transformer block.

A block's saved activations are kept on the device, recomputed in backward, or swapped to host
or NVMe; the runtime (core's ActivationManager) acts on whole blocks
(``tierwise.profile.activation_blocks``), so layers are summed per block and layers outside
every block (embeddings, the LM head) are always kept. Blocks that are not kept are ordered by
offloading benefit, recompute time saved per byte swapped (the block's forward seconds,
measured or FLOPs / FLOP/s, see ``tierwise_search.compute``, over its saved bytes): swapping a
block with much compute per byte saves the most recomputation per byte moved. The first ``x``
blocks in that order are swapped and the rest recomputed; ``x`` is the one that minimises the
predicted step time, where the cost model adds the swap traffic to the PCIe and SSD traffic of
the plan's model data (chunk fetches, gradient offload, the NVMe optimizer pipeline) and the
recompute time to compute (LoHan section 4). A choice's device bytes are those of its own
policy (every leaving block swapped, or every block recomputed), counted as the runtime holds
them ([Note: activation peak under a policy] in tierwise.planning.activation_peak: a recomputed
block keeps its inputs, a swapped one nothing, plus the blocks read back ahead); the model data
is placed for those bytes, and a split of ``x`` is tried only when its own peak fits the device
beside that placement (a recomputed block keeps its inputs on the device, so recomputing more
can need more than swapping everything). Keeping every block and recomputing every block are
choices of their own.

LoHan's own scheme is a choice too ("recompute from host", "recompute from nvme"): a block that
does not swap its saved activations is recomputed from its inputs, swapped to that tier
(``recompute_host`` / ``recompute_nvme``, [Note: recompute from swapped inputs] in
tierwise.runtime.activations.recompute), so the device holds neither; its own policy recomputes
every block that way, and a split swaps the first ``x`` blocks' saved activations instead. The
cost model adds both swaps' traffic and the recompute time.

With ``activation_checkpointing`` and ``activation_offload="auto"`` the runtime recomputes every
block (checkpointing comes before the plan's policy in
``tierwise.runtime.activations.policy.resolve_policy``), so that is the only choice offered.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tierwise.planning.activation_peak import (
    INPUT_SWAP_ACTIONS,
    ActivationPeak,
    activation_peak,
    block_input_bytes,
)
from tierwise.profile import Profile, activation_blocks

from tierwise_search.compute import block_seconds
from tierwise_search.cost import ActivationTraffic, Prediction


@dataclass(frozen=True)
class ActivationChoice:
    """Which layers leave the device, and where swapped ones go."""

    name: str
    """"keep", "checkpointing", "swap to host", "swap to nvme", "recompute from host",
    "recompute from nvme"."""
    leaving: tuple[str, ...]
    """Layers not kept, by offloading benefit (forward seconds per byte), highest first."""
    target: str | None
    """"host" or "nvme" for swaps; None: every leaving layer is recomputed."""
    device_bytes: int
    """Peak activation bytes on the device under this choice's own policy (before F_frag)."""
    peak: ActivationPeak
    """Its moments: where it peaks."""
    host_reserve: int
    """Host bytes reserved for swapped activations (all leaving layers, an upper bound)."""
    recompute: str = "recompute"
    """The action of a leaving block that is not swapped: "recompute", or "recompute_host" /
    "recompute_nvme" (from its inputs swapped to ``target``; then the choice's own policy
    recomputes every leaving block)."""


def block_usage(profile: Profile, seconds: dict[str, float]) -> dict[str, tuple[int, float]]:
    """Per block: (saved bytes, forward seconds); the seconds of every layer inside the block,
    whether it saves activations or not (recomputing a block re-runs all of it)."""
    return {
        block: (
            sum(profile.layer_activation_bytes[layer] for layer in layers),
            block_seconds(seconds, block),
        )
        for block, layers in activation_blocks(profile).items()
    }


def benefit(usage: tuple[int, float]) -> float:
    """Offloading benefit: recompute seconds saved per byte swapped."""
    nbytes, secs = usage
    return secs / nbytes if nbytes else 0.0


def _by_benefit(usage: dict[str, tuple[int, float]], blocks) -> tuple[str, ...]:
    position = {block: i for i, block in enumerate(usage)}  # ties: forward order
    return tuple(sorted(blocks, key=lambda block: (-benefit(usage[block]), position[block])))


def split_policy(
    usage: dict[str, tuple[int, float]],
    swapped,
    recomputed,
    target: str | None,
    recompute: str = "recompute",
) -> dict[str, str]:
    """Every block's action: ``swapped`` ones go to ``target``, ``recomputed`` ones get
    ``recompute``, the rest kept."""
    policy = dict.fromkeys(usage, "keep")
    policy.update(dict.fromkeys(recomputed, recompute))
    policy.update(dict.fromkeys(swapped, target))
    return policy


def _choice(
    profile: Profile,
    usage: dict[str, tuple[int, float]],
    name: str,
    leaving,
    target: str | None,
    recompute: str = "recompute",
) -> ActivationChoice:
    order = _by_benefit(usage, leaving)
    swapped = order[: _own_swapped(order, target, recompute)]
    policy = split_policy(usage, swapped, order[len(swapped) :], target, recompute)
    peak = activation_peak(profile, policy)
    reserve = 0
    if target == "host":  # the most any of its splits swaps to the host
        inputs = _moved_inputs(profile) if recompute in INPUT_SWAP_ACTIONS else {}
        reserve = sum(max(usage[b][0], inputs.get(b, 0)) for b in leaving)
    return ActivationChoice(name, order, target, peak.peak_bytes, peak, reserve, recompute)


def _own_swapped(order, target: str | None, recompute: str) -> int:
    """How many leaving blocks a choice's own policy swaps: all (swap choices), none (recompute
    choices, from swapped inputs or not)."""
    return len(order) if target and recompute == "recompute" else 0


def _moved_inputs(profile: Profile) -> dict[str, int]:
    """The bytes a block recomputed from swapped inputs moves each way (its inputs; those a
    checkpointed profile's blocks save)."""
    if profile.checkpointed:
        return {block: usage[0] for block, usage in block_usage(profile, {}).items()}
    return block_input_bytes(profile)


def activation_choices(
    profile: Profile, seconds: dict[str, float], *, offload: str, checkpointing: bool, nvme: bool
):
    """Candidate choices for Config.activation_offload ("none" | "host" | "nvme" | "auto");
    ``seconds``: forward seconds per layer."""
    usage = block_usage(profile, seconds)
    blocks = [block for block, (nbytes, secs) in usage.items() if nbytes > 0 or secs > 0]
    recompute_all = _choice(profile, usage, "checkpointing", blocks, None)
    if checkpointing and offload not in ("host", "nvme"):
        return [recompute_all]  # the runtime's precedence: see the module docstring
    keep = _choice(profile, usage, "keep", [], None)
    if offload == "none" or not blocks:
        return [keep]
    if offload in ("host", "nvme"):
        return [_choice(profile, usage, f"swap to {offload}", blocks, offload)]
    choices = [keep, recompute_all]
    for target in ("host", "nvme") if nvme else ("host",):
        choices.append(_choice(profile, usage, f"swap to {target}", blocks, target))
        choices.append(
            _choice(
                profile, usage, f"recompute from {target}", blocks, target, f"recompute_{target}"
            )
        )
    return choices


def traffic_for(
    profile: Profile,
    seconds: dict[str, float],
    swapped: tuple[str, ...],
    recomputed: tuple[str, ...],
    target: str | None,
    recompute: str = "recompute",
) -> ActivationTraffic:
    """The traffic and recompute time of swapping ``swapped`` to ``target`` and giving
    ``recomputed`` the ``recompute`` action (from inputs swapped to ``target``, they move too)."""
    usage = block_usage(profile, seconds)
    moved = float(sum(usage[block][0] for block in swapped))
    if recompute in INPUT_SWAP_ACTIONS:
        inputs = _moved_inputs(profile)
        moved += float(sum(inputs[block] for block in recomputed))
    return ActivationTraffic(
        recompute_s=float(sum(usage[block][1] for block in recomputed)),
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
    room: int | None = None,
) -> tuple[dict[str, str], ActivationTraffic, Prediction]:
    """The per-block policy minimising the predicted step under ``choice``, among the splits
    whose activation peak fits within ``room`` bytes (or the choice's own; None: any)."""
    order = choice.leaving
    usage = block_usage(profile, seconds)
    counts = range(len(order) + 1) if choice.target else [0]
    own = _own_swapped(order, choice.target, choice.recompute)
    best = None
    for swapped_count in counts:
        swapped, recomputed = order[:swapped_count], order[swapped_count:]
        policy = split_policy(usage, swapped, recomputed, choice.target, choice.recompute)
        if room is not None and swapped_count != own:
            if activation_peak(profile, policy).peak_bytes > max(room, choice.device_bytes):
                continue  # what it holds does not fit beside the model data
        traffic = traffic_for(
            profile, seconds, swapped, recomputed, choice.target, choice.recompute
        )
        prediction = evaluate(traffic)
        if best is None or prediction.total < best[2].total:
            best = (swapped_count, traffic, prediction)
    swapped_count, traffic, prediction = best
    policy = split_policy(
        usage, order[:swapped_count], order[swapped_count:], choice.target, choice.recompute
    )
    return policy, traffic, prediction


def block_reasons(
    profile: Profile, seconds: dict[str, float], choice: ActivationChoice, policy: dict[str, str]
) -> list[str]:
    """One line per block: its action and why."""
    usage = block_usage(profile, seconds)
    rank = {block: i + 1 for i, block in enumerate(choice.leaving)}
    swapped = sum(1 for b in choice.leaving if policy.get(b) in ("host", "nvme"))
    lines = []
    for block, action in policy.items():
        nbytes, secs = usage[block]
        head = (
            f"activations of {block}: {action} ({nbytes / 2**20:.1f} MiB saved, "
            f"{secs * 1e3:.2f} ms to recompute, {benefit(usage[block]) * 2**20 * 1e3:.3g} ms/MiB"
        )
        if action == "keep":
            why = (
                f"{choice.name}: nothing leaves the device"
                if not choice.leaving
                else "outside the blocks that leave"
            )
        elif action == "recompute" and choice.target is None:
            why = "checkpointing: every block is recomputed"
        elif action in INPUT_SWAP_ACTIONS:
            why = (
                f"benefit rank {rank[block]}/{len(choice.leaving)}: recomputed from its inputs "
                f"swapped to {choice.target} (LoHan), as swapping more than the top {swapped} "
                "saved activations would cost more link time than it saves compute"
            )
        elif action == "recompute":
            why = (
                f"benefit rank {rank[block]}/{len(choice.leaving)}: swapping more than the top "
                f"{swapped} to {choice.target} would cost more link time than it saves compute"
            )
        else:
            why = (
                f"benefit rank {rank[block]}/{len(choice.leaving)}: among the top {swapped}, "
                "whose swap hides behind compute better than recomputing them"
            )
        lines.append(f"{head}): {why}")
    return lines


__all__ = [
    "ActivationChoice",
    "activation_choices",
    "best_split",
    "block_reasons",
    "block_usage",
    "split_policy",
    "traffic_for",
]
