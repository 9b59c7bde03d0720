"""[Note: the rCache minimum]: the smallest rCache setup accepts trains; one block fewer is
refused at setup, in one line giving the minimum, before anything is changed."""

import re

import pytest
import tierwise
import torch
from helpers.models import tiny_batch, tiny_lora_model, tiny_model
from tierwise.config import ConfigError
from tierwise.plan import PlanError

KINDS = ["gpt2", "opt", "llama", "qwen2_moe", "mixtral"]
# PEFT LoRA: frozen base layers sharing an input ([Note: frozen modules are released after
# their own nodes]); gpt2's fused c_attn is a Conv1D, which PEFT wraps as well
LORA = {
    "lora-llama": ("llama", ("q_proj", "v_proj")),
    "lora-llama-qkv": ("llama", ("q_proj", "k_proj", "v_proj")),
    "lora-gpt2": ("gpt2", ("c_attn",)),
}


def build(kind: str):
    if kind == "opt-preset":  # the case: learned positions, tied embedding, 4096 chunks
        import transformers
        from tierwise.model_presets import preset_config

        config = preset_config("opt", "tiny", vocab_size=128, eos_id=127, max_positions=64)
        torch.manual_seed(0)  # a model on the CPU: the refusal leaves its values as they were
        model = transformers.AutoModelForCausalLM.from_config(config).train()
    elif kind in LORA:
        pytest.importorskip("peft", reason="the LoRA cases need peft (tierwise[peft])")
        model = tiny_lora_model(*LORA[kind])
    else:
        model = tiny_model(kind)
    return model


def setup(kind: str, chunk_size: int, blocks: int, checkpointing: bool = False):
    model = build(kind)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return tierwise.setup(
        model,
        opt,
        precision="fp32",
        device="cpu",
        chunk_size=chunk_size,
        param_placement="host",
        optimizer_placement="host",
        cache_blocks=blocks,
        activation_checkpointing=checkpointing,
    )


def minimum(kind: str, chunk_size: int, checkpointing: bool = False) -> int:
    """The minimum setup states when asked for a single block (1 when it accepts one)."""
    try:
        setup(kind, chunk_size, 1, checkpointing)
    except (ConfigError, PlanError) as err:  # setup's check, or a planner's (the same number)
        message = str(err)
        assert "\n" not in message
        return int(re.search(r"minimum of (\d+) rCache blocks", message).group(1))
    return 1


def assert_one_fewer_is_refused(
    kind: str, chunk_size: int, least: int, checkpointing: bool = False
) -> None:
    """One block below ``least`` is refused at setup, in one line, with nothing changed."""
    if least == 1:
        return
    fresh = build(kind)
    before = {n: p.detach().clone() for n, p in fresh.named_parameters()}
    with pytest.raises((ConfigError, PlanError), match=f"minimum of {least} rCache blocks"):
        tierwise.setup(
            fresh,
            torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad]),
            precision="fp32",
            device="cpu",
            chunk_size=chunk_size,
            param_placement="host",
            optimizer_placement="host",
            cache_blocks=least - 1,
            activation_checkpointing=checkpointing,
        )
    assert not hasattr(fresh, "_tierwise_engine")  # nothing changed on the model
    for name, param in fresh.named_parameters():
        assert torch.equal(param, before[name]) and not getattr(param, "_tierwise_managed", False)


@pytest.mark.parametrize("chunk_size", [1024, 4096])
@pytest.mark.parametrize("kind", [*KINDS, "opt-preset", *LORA])
def test_the_minimum_setup_accepts_trains_and_one_fewer_is_refused(kind, chunk_size):
    least = minimum(kind, chunk_size)
    model, opt = setup(kind, chunk_size, least)
    for step in range(2):  # the warm-up step and one replayed with Belady replacement
        model(**tiny_batch(seed=step)).loss.backward()
        opt.step()
        opt.zero_grad()
    assert_one_fewer_is_refused(kind, chunk_size, least)


@pytest.mark.parametrize("kind", [*KINDS, *LORA])
def test_the_minimum_holds_through_checkpoint_re_forward(kind):
    least = minimum(kind, 2048, checkpointing=True)
    model, opt = setup(kind, 2048, least, checkpointing=True)
    for step in range(2):
        model(**tiny_batch(seed=step)).loss.backward()
        opt.step()
        opt.zero_grad()
    assert_one_fewer_is_refused(kind, 2048, least, checkpointing=True)


def test_auto_plans_at_least_the_minimum():
    model = tiny_model("opt")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = tierwise.setup(
        model,
        opt,
        precision="fp32",
        device="cpu",
        chunk_size=1024,
        param_placement="host",
        optimizer_placement="host",
    )
    assert tierwise.engine_of(model).plan.cache_blocks >= minimum("opt", 1024)


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("kind", list(LORA))
def test_lora_at_the_minimum_is_bitwise_plain_peft(kind, checkpointing):
    """At the minimum, LoRA training equals plain PEFT with fused AdamW bit for bit (fp32)."""
    least = minimum(kind, 1024, checkpointing)
    ref = build(kind)
    if checkpointing:
        ref.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref_opt = torch.optim.AdamW(
        [p for p in ref.parameters() if p.requires_grad], lr=1e-2, fused=True
    )
    model, opt = setup(kind, 1024, least, checkpointing)
    for step in range(3):
        losses = []
        for m, o in ((ref, ref_opt), (model, opt)):
            loss = m(**tiny_batch(seed=step)).loss
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1]), step
    state = model.state_dict()
    for name, param in ref.state_dict().items():
        assert torch.equal(state[name], param), name
