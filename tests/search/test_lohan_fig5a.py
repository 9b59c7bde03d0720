"""LoHan's Figure 5a point (Llama 13B, batch 32 x 1024 tokens, bf16, one RTX 4090, 768 GiB of host
memory and an NVMe drive), as ``tierwise plan --activation-offload auto`` profiles it: every
activation choice counted as the runtime holds it ([Note: activation peak under a policy]) and
checked against a count by hand. Keeping, recomputing from inputs kept on the device and swapping
every block's saved activations each need more than the 24 GiB device before any model data;
LoHan's own scheme, every block recomputed from its inputs swapped to the host
(``recompute_host``, [Note: recompute from swapped inputs]), fits, and the plan is that."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("tierwise_search")
pytest.importorskip("tierwise_profiler")

from tierwise.planning.activation_peak import block_input_bytes, block_saved_bytes  # noqa: E402
from tierwise.target import target_hardware  # noqa: E402
from tierwise_search.activations import activation_choices  # noqa: E402
from tierwise_search.cli import plan_config, plan_profile  # noqa: E402
from tierwise_search.search import search_plan  # noqa: E402

pytestmark = pytest.mark.combined  # search + profiler

B, SEQ, H, FFN, HEADS, VOCAB, LAYERS = 32, 1024, 5120, 13824, 40, 32000, 40
HEAD_DIM = H // HEADS


def hand_block_bytes() -> int:
    """One HF Llama block's saved bytes in bf16 with fused attention (no s x s scores kept):
    Korthikanti et al.'s per-layer count redone for this block. Each RMSNorm keeps its fp32
    input (4bsh), the normalised bf16 (2bsh), its output (2bsh) and 1/rms (4bs); attention keeps
    q and k after rotation, v and its output (4 x 2bsh), the log-sum-exp (4bas) and the causal
    mask as a bf16 bias (2bss); the SwiGLU MLP keeps gate, SiLU(gate), up and their product
    (4 x 2bsf). So 24bsh + 8bs + 4bas + 2bss + 8bsf (about 45.6 sbh at f = 2.7h, where GPT's
    LayerNorm block with a 4h MLP keeps 34 sbh)."""
    bsh, bs = B * SEQ * H, B * SEQ
    return 24 * bsh + 8 * bs + 4 * bs * HEADS + 2 * bs * SEQ + 8 * bs * FFN


def hand_loss_bytes() -> int:
    """Outside the blocks at the loss's backward: the bf16 logits the output keeps (2bsV), the
    fp32 log-softmax cross-entropy keeps (4bsV) and the two fp32 gradients of its backward
    (8bsV); the final norm's saved bytes (8bsh + 4bs) and the rotary tables (cos and sin)."""
    bs = B * SEQ
    return 14 * bs * VOCAB + 8 * bs * H + 4 * bs + 2 * SEQ * HEAD_DIM * 2


def hand_shared_inputs() -> int:
    """What every block is handed besides its hidden states, counted with the first: cos and
    sin, the boolean causal mask (b x s x s) and the position ids."""
    return 2 * SEQ * HEAD_DIM * 2 + B * SEQ * SEQ + SEQ * 8


def test_fig5a_activations_by_hand_and_accepted_recomputing_from_host_inputs(tmp_path):
    args = argparse.Namespace(
        model="llama",
        size="13b",
        seq=SEQ,
        batch=B,
        precision="bf16",
        host_memory="768GiB",
        nvme=str(tmp_path),
        checkpointing=False,
        activation_offload="auto",
        lora=None,
        lora_targets=None,
    )
    target = target_hardware(
        spec="rtx4090,pcie4-nvme", device=None, gpus=1, nvme_path=str(tmp_path)
    )
    config = plan_config(args, target.hardware.device_type)
    profile = plan_profile(args, config)

    saved, inputs = block_saved_bytes(profile), block_input_bytes(profile)
    assert len(saved) == LAYERS
    assert set(saved.values()) == {hand_block_bytes()}
    hidden = 2 * B * SEQ * H
    assert inputs == {
        b: hidden + (hand_shared_inputs() if i == 0 else 0) for i, b in enumerate(saved)
    }

    choices = {
        c.name: c
        for c in activation_choices(profile, {}, offload="auto", checkpointing=False, nvme=True)
    }
    assert set(choices) == {
        "keep",
        "checkpointing",
        "swap to host",
        "swap to nvme",
        "recompute from host",
        "recompute from nvme",
    }
    scalars = 64  # the loss and its few scalars
    # recompute every block: at the loss, what is outside the blocks plus every block's inputs
    recompute = choices["checkpointing"]
    want = hand_loss_bytes() + LAYERS * hidden + hand_shared_inputs()
    assert (recompute.peak.moment, 0 <= recompute.device_bytes - want <= scalars) == (
        "the loss",
        True,
    )
    # swap every block: nothing held, two blocks read back ahead at the loss, and at least one
    # block's saved bytes plus two read ahead in the backward of the last
    swap = choices["swap to host"]
    assert 0 <= swap.peak.loss_bytes - (hand_loss_bytes() + 2 * hand_block_bytes()) <= scalars
    assert swap.device_bytes >= 3 * hand_block_bytes()
    assert choices["keep"].device_bytes == profile.peak_activation_bytes
    # 1.25 x each of those alone is more than the device, before any model data
    device = target.hardware.device_memory
    for name in ("keep", "checkpointing", "swap to host", "swap to nvme"):
        assert config.frag_factor * choices[name].device_bytes + profile.buffer_bytes > device
    # recompute every block from inputs swapped to the host: the device holds only the inputs
    # every block shares (kept by the checkpoints), and at the loss two blocks' inputs read
    # back ahead (the first block's, with the shared ones, is the largest)
    lohan = choices["recompute from host"]
    assert lohan.peak.held_bytes == {
        b: hand_shared_inputs() if i == 0 else 0 for i, b in enumerate(saved)
    }
    want = hand_loss_bytes() + hand_shared_inputs() + 2 * (hidden + hand_shared_inputs())
    assert lohan.peak.moment == "the loss"
    assert 0 <= lohan.device_bytes - want <= scalars
    assert lohan.device_bytes == choices["recompute from nvme"].device_bytes
    assert config.frag_factor * want + profile.buffer_bytes < device

    # accepted: the plan recomputes every block from host inputs, its activation allowance is
    # 1.25 x the hand count, and that plus its model data on the device fits the device
    plan = search_plan(profile, target.hardware, config)
    assert set(plan.activation_policy.values()) == {"recompute_host"}
    assert len(plan.activation_policy) == LAYERS
    assert 0 <= plan.activation_allowance - int(config.frag_factor * want) <= 2 * scalars
    room = config.alloc_fraction * (device - profile.buffer_bytes - plan.activation_allowance)
    assert 0 < plan.device_allowance <= room
    assert plan.predicted_step_s["recompute"] > 0
    # every block's inputs go to the host and come back once a step
    moved = LAYERS * hidden + hand_shared_inputs()
    assert plan.predicted_bytes["d2h"] >= moved and plan.predicted_bytes["h2d"] >= moved
