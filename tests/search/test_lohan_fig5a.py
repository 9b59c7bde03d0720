"""LoHan's Figure 5a point (Llama 13B, batch 32 x 1024 tokens, bf16, one RTX 4090, 768 GiB of host
memory and an NVMe drive), as ``tierwise plan --activation-offload auto`` profiles it: every
activation choice counted as the runtime holds it ([Note: activation peak under a policy]) and
checked against a count by hand. Under that count no choice fits a 24 GiB device, whatever the
model data, so the point is refused (LoHan itself recomputes blocks from inputs swapped to the
host, an action tierwise's runtime does not have; bench/lohan_5a.py gives its bytes)."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("tierwise_search")
pytest.importorskip("tierwise_profiler")

from tierwise.planning.activation_peak import block_input_bytes, block_saved_bytes  # noqa: E402
from tierwise.target import target_hardware  # noqa: E402
from tierwise_search.activations import activation_choices  # noqa: E402
from tierwise_search.cli import plan_config, plan_profile  # noqa: E402

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


def test_fig5a_activations_by_hand_and_refused_on_a_24_gib_device(tmp_path):
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
    assert set(choices) == {"keep", "checkpointing", "swap to host", "swap to nvme"}
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
    # refused: 1.25 x the smallest choice alone is more than the device, before any model data
    smallest = min(c.device_bytes for c in choices.values())
    assert smallest == recompute.device_bytes
    assert config.frag_factor * smallest + profile.buffer_bytes > target.hardware.device_memory
