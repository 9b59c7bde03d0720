"""The device bytes of activations under a per-block policy: the largest moment of the step.

[Note: activation peak under a policy]
The profile is of a step that keeps every block's saved activations (``S_j``: the bytes its
layers save, ``tierwise.profile.activation_blocks``). Between its forward and its backward a
block holds on the device, by action: keep ``S_j``; recompute the tensors it was handed
(``I_j``, ``Profile.module_input_bytes``: what the checkpoint keeps); host or nvme nothing (the
bytes are on the host or the storage tier: a way to fit, counted as one); recompute_host or
recompute_nvme (LoHan's scheme: recompute from inputs swapped out) none of its inputs but those it
shares with the other blocks ([Note: recompute from swapped inputs] in
tierwise.runtime.activations.recompute: the tensors handed by keyword stay on the device). The
profile counts a tensor handed to several blocks with the first, so a block's shared inputs are
its ``I_j`` less the smallest ``I`` of those blocks: an upper bound (a shared tensor handed
positionally is swapped with each block). The step's moments:

- the loss: everything outside the blocks at the loss's backward (the logits, the loss's fp32
  copies and their gradients: the profile's bytes there less every ``S_j``) plus what the
  blocks hold, plus the swapped blocks already read back;
- block j's backward: what the blocks before it hold, plus its working set ``W_j``, the
  profile's most live bytes while backward was in block j less the ``S`` of the blocks before
  it ([Note: backward peaks by module] in tierwise_profiler.recorder): its own saved
  activations, brought back or recomputed, its gradients and temporaries, and whatever outside
  the blocks is still alive (the logits the caller's output holds). A recomputed block also
  holds its inputs until its backward ends (a block recomputed from swapped inputs too, once
  read back); the swapped blocks before it read back ahead.
- read-ahead: in backward the runtime reads the next swapped blocks back while the bytes read and
  not yet used stay within twice the largest swapped block, and at least the next one
  ([Note: activation swapping] in tierwise.runtime.activations.swaps). A swapped block moves
  ``S_j``, one recomputed from swapped inputs ``I_j``.

A forward is smaller than its block's backward (which holds the same saved activations plus
their gradients), so it is not a moment of its own. A profile taken with checkpointing
(``Profile.checkpointed``) already saves only each block's inputs and re-runs the block in its
backward, so there "recompute" holds ``S_j`` and recompute_host / recompute_nvme move ``S_j``
and hold nothing (its S_j do not tell shared inputs apart). The read-ahead is a bound: the runtime's budget
includes the unused part of the block in backward. A profile without per-module backward peaks
(made by hand or traced by the runtime) bounds ``W_j`` by ``S_j`` plus the bytes outside the
blocks at the step's peak; one without input sizes counts no inputs (it cannot know them).
"""

from __future__ import annotations

from dataclasses import dataclass

from tierwise.profile import Profile, activation_blocks

SWAP_ACTIONS = ("host", "nvme")
"""Swap a block's saved activations."""
INPUT_SWAP_ACTIONS = ("recompute_host", "recompute_nvme")
"""Recompute a block from its inputs, swapped: [Note: recompute from swapped inputs]."""
READ_AHEAD_BLOCKS = 2
"""The runtime's read-ahead budget in backward, in largest swapped blocks."""


@dataclass(frozen=True, kw_only=True)
class ActivationPeak:
    """The device bytes of activations under one policy and the moment they peak."""

    peak_bytes: int
    """The largest of the moments below, bytes."""
    moment: str
    """Where it peaks: "the loss" or "the backward of <block>"."""
    loss_bytes: int
    """At the loss's backward, bytes."""
    block_bytes: dict[str, int]
    """At each block's backward, bytes."""
    held_bytes: dict[str, int]
    """What each block holds on the device between its forward and its backward, bytes."""


def block_saved_bytes(profile: Profile) -> dict[str, int]:
    """``S_j``: the bytes each block's layers save, in forward order (a checkpointed profile
    lists its blocks in the order backward re-runs them)."""
    blocks = activation_blocks(profile)
    first_use: dict[str, int] = {}
    for index, name in enumerate(profile.forward_order):
        for block in blocks:
            if block not in first_use and name.startswith(block + "."):
                first_use[block] = index
    listed = list(blocks)
    ordered = sorted(
        listed, key=lambda b: (first_use.get(b, len(profile.forward_order)), listed.index(b))
    )
    return {
        block: sum(profile.layer_activation_bytes[layer] for layer in blocks[block])
        for block in ordered
    }


def block_input_bytes(profile: Profile) -> dict[str, int]:
    """``I_j``: the bytes a recompute of each block keeps (its inputs)."""
    out = {}
    for block in activation_blocks(profile):
        out[block] = profile.module_input_bytes.get(block, 0)
    return out


def activation_peak(profile: Profile, policy: dict[str, str]) -> ActivationPeak:
    """The device bytes of activations when each block gets ``policy``'s action (a block it
    does not name is kept): [Note: activation peak under a policy]."""
    saved = block_saved_bytes(profile)
    checkpointed = profile.checkpointed
    # a checkpointed profile's S_j are the inputs its checkpoints keep, already in W_j
    inputs = saved if checkpointed else block_input_bytes(profile)
    from_swapped = [b for b in saved if policy.get(b) in INPUT_SWAP_ACTIONS]
    least_inputs = min((inputs[b] for b in from_swapped), default=0)
    held, moved = {}, {}
    for block, nbytes in saved.items():
        action = policy.get(block, "keep")
        if action in SWAP_ACTIONS:
            held[block], moved[block] = 0, nbytes
        elif action in INPUT_SWAP_ACTIONS:  # its shared inputs stay (unknown when checkpointed)
            shared = 0 if checkpointed else inputs[block] - least_inputs
            held[block], moved[block] = shared, inputs[block]
        elif action == "recompute" and not checkpointed:
            held[block] = inputs[block]
        else:
            held[block] = nbytes
    budget = READ_AHEAD_BLOCKS * max(moved.values(), default=0)
    total_saved = sum(saved.values())
    peaks = profile.backward_peak_bytes
    outside = max(peaks.get("", profile.peak_activation_bytes) - total_saved, 0)
    loss = outside + sum(held.values()) + min(budget, sum(moved.values()))
    blocks: dict[str, int] = {}
    before_saved = before_held = before_moved = 0
    inside = _peak_inside(peaks, saved)
    for block, nbytes in saved.items():
        if block in inside:
            working = max(inside[block] - before_saved, nbytes)
        else:
            working = nbytes + max(profile.peak_activation_bytes - total_saved, 0)
        if policy.get(block) in ("recompute", *INPUT_SWAP_ACTIONS) and not checkpointed:
            working += inputs[block]
        blocks[block] = before_held + working + min(budget, before_moved)
        before_saved += nbytes
        before_held += held[block]
        before_moved += moved.get(block, 0)
    peak, moment = loss, "the loss"
    for block, nbytes in blocks.items():
        if nbytes > peak:
            peak, moment = nbytes, f"the backward of {block}"
    return ActivationPeak(
        peak_bytes=peak, moment=moment, loss_bytes=loss, block_bytes=blocks, held_bytes=held
    )


def _peak_inside(peaks: dict[str, int], blocks) -> dict[str, int]:
    """The most live bytes while backward was in each block (any module inside it)."""
    out: dict[str, int] = {}
    for name, nbytes in peaks.items():
        parts = name.split(".")
        for end in range(1, len(parts) + 1):
            block = ".".join(parts[:end])
            if block in blocks:
                out[block] = max(out.get(block, 0), nbytes)
                break
    return out


def uniform_policy(profile: Profile, action: str) -> dict[str, str]:
    """Every block of ``profile`` gets ``action``."""
    return dict.fromkeys(activation_blocks(profile), action)


__all__ = [
    "INPUT_SWAP_ACTIONS",
    "SWAP_ACTIONS",
    "ActivationPeak",
    "activation_peak",
    "block_input_bytes",
    "block_saved_bytes",
    "uniform_policy",
]
