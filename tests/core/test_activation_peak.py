"""[Note: activation peak under a policy], by hand: a profile of three blocks with known saved
bytes, inputs and backward peaks, and the device bytes each policy holds at each moment."""

from tierwise import Profile
from tierwise.planning.activation_peak import activation_peak, uniform_policy

MIB = 2**20
S = 100 * MIB  # each block saves this much in a step that keeps everything
IN = 10 * MIB  # each block's input: what its checkpoint keeps
OUT = 40 * MIB  # saved outside the blocks (the head), alive at the loss
LOSS = 30 * MIB  # the loss's own gradients and temporaries at its backward
EXTRA = 25 * MIB  # what a block's backward needs beyond its saved bytes (gradients, the head's
# logits the caller's output keeps)


def _profile() -> Profile:
    # in the kept step: at the loss every block's S and the head's bytes are alive; while backward
    # is in block j, the saved bytes of the blocks before it, its own and EXTRA
    peaks = {"": 3 * S + OUT + LOSS, "head": 3 * S + OUT}
    for j in range(3):
        peaks[f"blocks.{j}.mlp"] = j * S + S + EXTRA
        peaks[f"blocks.{j}.attn"] = j * S + S // 2 + EXTRA  # later in its backward: less
    return Profile(
        forward_order=[f"blocks.{j}.attn.w" for j in range(3)] + ["head.w"],
        layer_activation_bytes={
            f"blocks.{j}.{m}": S // 2 for j in range(3) for m in ("attn", "mlp")
        }
        | {"head": OUT},
        peak_activation_bytes=3 * S + OUT + LOSS,
        module_input_bytes={f"blocks.{j}": IN for j in range(3)},
        backward_peak_bytes=peaks,
    )


def test_keep_is_the_profiled_step():
    peak = activation_peak(_profile(), {})
    assert peak.loss_bytes == 3 * S + OUT + LOSS
    assert peak.block_bytes == {f"blocks.{j}": j * S + S + EXTRA for j in range(3)}
    assert (peak.peak_bytes, peak.moment) == (3 * S + OUT + LOSS, "the loss")


def test_recompute_holds_every_blocks_inputs():
    peak = activation_peak(_profile(), uniform_policy(_profile(), "recompute"))
    assert peak.held_bytes == dict.fromkeys(peak.held_bytes, IN)
    assert peak.loss_bytes == OUT + LOSS + 3 * IN
    # block j: the inputs of the blocks before it, its re-run working set and its own inputs
    assert peak.block_bytes == {f"blocks.{j}": j * IN + S + EXTRA + IN for j in range(3)}
    assert peak.peak_bytes == max(OUT + LOSS + 3 * IN, 2 * IN + S + EXTRA + IN)


def test_swapping_holds_nothing_but_the_blocks_read_back_ahead():
    peak = activation_peak(_profile(), uniform_policy(_profile(), "host"))
    assert peak.held_bytes == dict.fromkeys(peak.held_bytes, 0)
    # read-ahead: up to two blocks (twice the largest swapped one) of those not yet in backward
    assert peak.loss_bytes == OUT + LOSS + 2 * S
    assert peak.block_bytes == {
        "blocks.0": S + EXTRA,
        "blocks.1": S + EXTRA + S,
        "blocks.2": S + EXTRA + 2 * S,
    }
    assert (peak.peak_bytes, peak.moment) == (3 * S + EXTRA, "the backward of blocks.2")


def test_a_mixed_policy_counts_each_block_by_its_action():
    policy = {"blocks.0": "keep", "blocks.1": "recompute", "blocks.2": "nvme"}
    peak = activation_peak(_profile(), policy)
    assert peak.held_bytes == {"blocks.0": S, "blocks.1": IN, "blocks.2": 0}
    assert peak.loss_bytes == OUT + LOSS + S + IN + S  # one swapped block to read back
    assert peak.block_bytes == {
        "blocks.0": S + EXTRA,
        "blocks.1": S + (S + EXTRA) + IN,
        "blocks.2": S + IN + (S + EXTRA),
    }


def test_a_checkpointed_profile_already_saves_only_inputs():
    profile = _profile()
    profile.checkpointed = True  # its S are what each checkpoint keeps
    assert activation_peak(profile, uniform_policy(profile, "recompute")) == activation_peak(
        profile, {}
    )


def test_without_backward_peaks_a_block_is_bounded_by_the_bytes_outside_at_the_peak():
    profile = _profile()
    profile.backward_peak_bytes = {}
    peak = activation_peak(profile, uniform_policy(profile, "host"))
    assert peak.loss_bytes == OUT + LOSS + 2 * S
    assert peak.block_bytes["blocks.2"] == S + (OUT + LOSS) + 2 * S
