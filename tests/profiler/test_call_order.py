"""Call order, tied parameters and checkpoint blocks of the fake-tensor profile vs real runs."""

from __future__ import annotations

import pytest

pytest.importorskip("tierwise_profiler")

import torch  # noqa: E402
from helpers.models import TINY_KINDS, tiny_batch, tiny_model  # noqa: E402
from profiler_reference import recorded_order  # noqa: E402
from tierwise_profiler.model_profile import profile_model  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("kind", TINY_KINDS)
def test_order_matches_module_hooks_of_a_real_step(kind, checkpointing):
    model = tiny_model(kind)
    batch = tiny_batch()
    profile = profile_model(model, batch, precision="fp32", activation_checkpointing=checkpointing)
    if checkpointing:
        model.activation_checkpointing_enable()
    forward, backward = recorded_order(model, batch)
    assert profile.forward_order == forward
    assert profile.backward_order == backward


def test_tied_embedding_is_one_parameter_used_twice():
    model = tiny_model("gpt2")
    profile = profile_model(model, tiny_batch(), precision="fp32")
    wte = profile.param("lm_head.weight")
    assert wte.name == "transformer.wte.weight"
    assert wte.aliases == ("lm_head.weight",)
    assert profile.multi_use == ["transformer.wte.weight"]
    assert profile.forward_order.count("transformer.wte.weight") == 2
    assert len(profile.params) == len(list(model.parameters()))
    assert profile.total_numel == sum(p.numel() for p in model.parameters())
    assert profile.module_params["lm_head"] == ["transformer.wte.weight"]
    assert profile.module_params["transformer.h.0.attn.c_attn"] == [
        "transformer.h.0.attn.c_attn.weight",
        "transformer.h.0.attn.c_attn.bias",
    ]


def test_untied_llama_has_no_multi_use():
    assert profile_model(tiny_model("llama"), tiny_batch(), precision="fp32").multi_use == []


def test_each_checkpointed_block_is_one_operator_over_its_parameters():
    model = tiny_model("gpt2")
    profile = profile_model(model, tiny_batch(), precision="fp32", activation_checkpointing=True)
    blocks = [sorted(block) for block in profile.checkpoint_blocks]
    expected = [
        sorted(
            name for name, _ in model.named_parameters() if name.startswith(f"transformer.h.{i}.")
        )
        for i in (1, 0)  # backward re-runs the last block first
    ]
    assert blocks == expected
    assert profile_model(model, tiny_batch(), precision="fp32").checkpoint_blocks == []


def test_model_is_left_as_it_was():
    model = tiny_model("gpt2").eval()
    before = {name: p for name, p in model.named_parameters()}
    profile_model(model, tiny_batch(), activation_checkpointing=True)
    assert {name: p for name, p in model.named_parameters()} == before
    assert not model.training
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    assert all(p.grad is None for p in model.parameters())


class CheckpointedMLP(torch.nn.Module):
    """Plain torch.utils.checkpoint around each block (reentrant or not)."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.reentrant = reentrant
        self.inp = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.LayerNorm(16))
            for _ in range(3)
        )
        self.out = torch.nn.Linear(16, 1)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=self.reentrant)
        return self.out(h).sum()


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_torch_checkpoint_blocks_and_order(reentrant):
    torch.manual_seed(0)
    model = CheckpointedMLP(reentrant)
    x = torch.randn(4, 8)
    profile = profile_model(model, x, precision="fp32")
    assert [sorted(block) for block in profile.checkpoint_blocks] == [
        sorted(f"blocks.{i}.{p}" for p in ("0.weight", "0.bias", "2.weight", "2.bias"))
        for i in (2, 1, 0)
    ]
    forward, backward = recorded_order(model, x)
    assert profile.forward_order == forward
    assert profile.backward_order == backward
