"""``recompute_host``: a block recomputed in backward from its inputs, swapped to the host between
its forward and its backward ([Note: recompute from swapped inputs]; LoHan's scheme; the nvme
variant is in tests/nvme/test_activation_swap.py)."""

from __future__ import annotations

import pytest
import tierwise
import torch
from helpers.models import tiny_model
from helpers.train import max_rel_diff, run_reference, run_tierwise, train
from tierwise.config import ConfigError

EVERY_BLOCK = {
    "gpt2": {"transformer.h.*": "recompute_host"},
    "llama": {"model.layers.*": "recompute_host"},
}
FINAL_NORM = {"gpt2": "transformer.ln_f", "llama": "model.norm"}


def _same(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def hand_input_bytes(kind: str, *, batch: int = 2, seq: int = 16) -> int:
    """The bytes one block's checkpoint saves, in fp32: the hidden states (b x s x h) it is handed
    positionally, and for GPT-2 also its float causal mask (b x 1 x s x s), which GPT-2 hands
    every block positionally too. Llama hands the mask and rotary tables by keyword: they stay
    on the device, kept by the checkpoint."""
    config = tiny_model(kind).config
    hidden = batch * seq * config.hidden_size * 4
    return hidden + (batch * seq * seq * 4 if kind == "gpt2" else 0)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_every_block_recomputed_from_host_inputs_trains_bitwise_like_keep_and_recompute(
    kind, precision
):
    kw = dict(precision=precision, device="cpu")
    base_losses, base = run_tierwise(kind, 2, **kw)
    recompute_losses, recompute = run_tierwise(kind, 2, activation_checkpointing=True, **kw)
    losses, model = run_tierwise(kind, 2, activation_policy=EVERY_BLOCK[kind], **kw)
    assert losses == base_losses == recompute_losses
    assert _same(model, base) and _same(model, recompute)
    stats = tierwise.engine_of(model).stats()
    act = stats["activations"]
    assert act["policy"] == {"recompute_host": 2}
    assert act["recomputed_blocks"] == 2
    assert act["saved_peak_bytes"] == 0  # nothing saved stays on the device
    assert act["swapped_out_bytes"]["host"] > 0
    assert act["swapped_in_bytes"] == act["swapped_out_bytes"]
    assert stats["moved_bytes"]["act:device->host"] == stats["moved_bytes"]["act:host->device"]
    if precision == "fp32":  # plain PyTorch, to test_reference's tolerance (Invariant 2)
        ref_losses, reference = run_reference(kind, 2)
        for a, b in zip(losses, ref_losses, strict=True):
            assert abs(a - b) <= 1e-6 * abs(b)
        assert max_rel_diff(model.state_dict(), reference) <= 1e-6


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_between_forward_and_backward_the_device_holds_no_block_inputs(kind):
    model = tiny_model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = tierwise.setup(
        model, opt, device="cpu", precision="fp32", activation_policy=EVERY_BLOCK[kind]
    )
    engine = tierwise.engine_of(model)
    train(model, opt, 1)  # the warm-up step
    seen = []
    norm = dict(model.named_modules())[FINAL_NORM[kind]]
    # the final norm runs after the last block's forward, before the backward reads any back
    handle = norm.register_forward_hook(lambda *a: seen.append(engine.activations.live_bytes()))
    train(model, opt, 1, first_seed=1)
    handle.remove()
    assert seen == [{"device": 0, "host": 2 * hand_input_bytes(kind), "nvme": 0}]
    act = engine.stats()["activations"]
    assert act["swapped_out_bytes"] == {"host": 2 * hand_input_bytes(kind), "nvme": 0}
    assert act["saved_peak_bytes"] == 0
    assert engine.activations.swapped_now() == {"device": 0, "host": 0, "nvme": 0}


def test_mixed_with_the_other_actions_and_accumulation_matches_keep():
    kw = dict(precision="fp32", device="cpu", train_kwargs=dict(accum=2))
    base_losses, base = run_tierwise("llama", 2, **kw)
    policy = {"model.layers.0": "recompute_host", "model.layers.1": "host"}
    losses, model = run_tierwise("llama", 2, activation_policy=policy, **kw)
    assert losses == base_losses and _same(model, base)
    act = tierwise.engine_of(model).stats()["activations"]
    assert act["policy"] == {"recompute_host": 1, "host": 1}
    assert act["recomputed_blocks"] == 2  # one block, two micro-batches


def test_hf_checkpointing_turned_on_by_the_user_does_not_recompute_twice():
    model = tiny_model("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    model, opt = tierwise.setup(
        model, opt, device="cpu", precision="fp32", activation_policy=EVERY_BLOCK["llama"]
    )
    calls = [0]
    for name, module in model.named_modules():
        if name.endswith(".mlp"):
            module.register_forward_pre_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    base_losses, base = run_tierwise("llama", 1, precision="fp32", device="cpu")
    assert train(model, opt, 1) == base_losses and _same(model, base)
    assert calls[0] == 2 * 2  # each block: its forward and one recompute


def test_recompute_nvme_without_nvme_path_is_a_config_error():
    with pytest.raises(ConfigError, match=r"needs nvme_path"):
        tierwise.Config(device="cpu", activation_policy={"model.layers.*": "recompute_nvme"})
    with pytest.raises(ConfigError, match=r"choose one of .*recompute_host, recompute_nvme"):
        tierwise.Config(device="cpu", activation_policy={"model.layers.*": "recompute_disk"})


def _stack_profile(blocks: int, numel: int, act: int, inputs: int):
    from tierwise import ParamInfo, Profile

    names = [f"layers.{b}.w" for b in range(blocks)]
    return Profile(
        params=[ParamInfo(name=n, shape=(numel,), numel=numel) for n in names],
        forward_order=names,
        backward_order=names[::-1],
        module_params={n[:-2]: [n] for n in names},
        layer_activation_bytes={f"layers.{b}": act for b in range(blocks)},
        module_input_bytes={f"layers.{b}": inputs for b in range(blocks)},
        peak_activation_bytes=blocks * act,
    )


def test_core_auto_recomputes_from_host_inputs_only_when_recomputing_does_not_fit():
    from tierwise import Config, Hardware
    from tierwise.planning.activation_peak import activation_peak, uniform_policy
    from tierwise.planning.planner import default_plan

    mib = 1 << 20
    profile = _stack_profile(4, mib, 100 * mib, 40 * mib)  # S_j 100 MiB, I_j 40 MiB
    # by hand, at the last block's backward: recompute holds the inputs of the three before it
    # and its own beside its 100 MiB (3 x 40 + 140); from host inputs it holds none, its own
    # read back and two blocks' read ahead (140 + 2 x 40)
    recompute = activation_peak(profile, uniform_policy(profile, "recompute"))
    from_host = activation_peak(profile, uniform_policy(profile, "recompute_host"))
    assert (recompute.peak_bytes, from_host.peak_bytes) == (260 * mib, 220 * mib)
    assert from_host.held_bytes == dict.fromkeys(from_host.held_bytes, 0)
    need = 4 * mib * (2 + 14)  # bf16 params + fp32 master/moments + bf16 grads: 64 MiB

    def plan_for(capacity):
        return default_plan(
            profile=profile,
            config=Config(device="cpu", activation_offload="auto"),
            hardware=Hardware(device_type="cuda", device_memory=capacity),
        )

    # 0.95 x (364 - 1.25 x 260) MiB = 37 MiB < 64 MiB <= 0.95 x (364 - 1.25 x 220) = 84.6 MiB
    plan = plan_for(int(1.25 * 240 * mib) + need)
    assert plan.activation_policy == {f"layers.{b}": "recompute_host" for b in range(4)}
    assert plan.param_tier == plan.optim_tier == "device"
    assert any("from inputs swapped to the host" in r for r in plan.reasons)
    # with room to recompute from inputs on the device, that is chosen (no traffic)
    roomy = plan_for(int(1.25 * 260 * mib) + 2 * need)
    assert set(roomy.activation_policy.values()) == {"recompute"}


def test_a_plain_block_stack_moves_exactly_each_blocks_input():
    """A stack of Linear -> tanh blocks under the manager alone: each block's checkpoint saves
    its input (rows x width fp32, half of what the block itself saves), and the gradients are the
    plain stack's, bit for bit."""
    from helpers.block_stack import block_bytes, gradients

    shape = dict(rows=64, width=32, depth=3)
    reference, _ = gradients("cpu", **shape)
    grads, stats = gradients("cpu", **shape, policy="recompute_host")
    assert all(torch.equal(grads[k], reference[k]) for k in reference)
    moved = shape["depth"] * block_bytes(shape["rows"], shape["width"]) // 2
    assert stats["swapped_out_bytes"] == {"host": moved, "nvme": 0}
    assert stats["swapped_in_bytes"] == stats["swapped_out_bytes"]
    assert (stats["recomputed_blocks"], stats["saved_peak_bytes"]) == (shape["depth"], 0)
