"""A model built on the meta device sets up and trains exactly like the same model built on the
CPU, for every family the hardware presets and size presets cover (buffers included: rotary
``inv_freq`` is not in the state dict, so only a correct materialisation gives equal losses)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import tierwise  # noqa: E402
from helpers.meta import assert_meta_trains_like_cpu  # noqa: E402

FAMILIES = ("gpt2", "opt", "llama", "mistral", "qwen2", "qwen2_moe", "mixtral")


@pytest.mark.parametrize("family", FAMILIES)
def test_training_after_meta_setup_equals_training_after_cpu_setup(family):
    assert_meta_trains_like_cpu(family)


def test_a_meta_buffer_no_initialiser_computes_is_an_error_and_setup_changes_nothing():
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)
            self.register_buffer("scale", torch.ones(8))  # computed in __init__ only

        def forward(self, x):
            return self.linear(x) * self.scale

    with torch.device("meta"):
        model = Scaled()
    with pytest.raises(
        ValueError, match="cannot compute buffer scale of a model built on the meta"
    ):
        tierwise.setup(model, torch.optim.AdamW(model.parameters()), device="cpu")
    assert model.scale.is_meta and model.linear.weight.is_meta

    Scaled.reset_parameters = lambda self: self.linear.reset_parameters()  # leaves scale alone
    with torch.device("meta"):
        model = Scaled()
    with pytest.raises(
        ValueError, match="buffer scale of a model built on the meta device has no values"
    ):
        tierwise.setup(model, torch.optim.AdamW(model.parameters()), device="cpu")
    assert model.scale.is_meta and model.linear.weight.is_meta
