"""A model built on the meta device sets up and trains exactly like the same model built on the
CPU, for every family the hardware presets and size presets cover (buffers included: rotary
``inv_freq`` is not in the state dict, so only a correct materialisation gives equal losses)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import tierwise  # noqa: E402
from helpers.models import _config, tiny_batch, tiny_model  # noqa: E402

FAMILIES = ("gpt2", "opt", "llama", "mistral", "qwen2", "qwen2_moe", "mixtral")
STEPS = 3


def _train(model, optimizer, steps: int) -> list[float]:
    losses = []
    for step in range(steps):
        loss = model(**tiny_batch(seed=step)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("family", FAMILIES)
def test_training_after_meta_setup_equals_training_after_cpu_setup(family):
    import transformers

    options = dict(  # every chunk offloaded to host: fetched into 6 rCache blocks
        precision="fp32", device="cpu", chunk_size=4096, cache_blocks=6,
        param_placement="host", optimizer_placement="host",
    )
    reference = tiny_model(family, seed=0)
    weights = {k: v.clone() for k, v in reference.state_dict().items()}
    cpu_buffers = {k: v.clone() for k, v in reference.named_buffers()}
    cpu_model, cpu_opt = tierwise.setup(
        reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), **options
    )

    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(_config(family)).train()
    assert all(b.is_meta for b in meta.buffers())
    meta_model, meta_opt = tierwise.setup(
        meta, torch.optim.AdamW(meta.parameters(), lr=1e-2), **options
    )
    meta_model.load_state_dict(weights)  # same starting point; buffers come from setup alone
    try:
        buffers = dict(meta_model.named_buffers())
        assert buffers.keys() == cpu_buffers.keys()
        for name, value in cpu_buffers.items():
            assert torch.equal(buffers[name], value), name
        assert _train(meta_model, meta_opt, STEPS) == _train(cpu_model, cpu_opt, STEPS)
        for (name, a), b in zip(
            meta_model.state_dict().items(), cpu_model.state_dict().values(), strict=True
        ):
            assert torch.equal(a, b), name
    finally:
        tierwise.engine_of(meta_model).close()
        tierwise.engine_of(cpu_model).close()


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
    with pytest.raises(ValueError, match="cannot compute buffer scale of a model built on the meta"):
        tierwise.setup(model, torch.optim.AdamW(model.parameters()), device="cpu")
    assert model.scale.is_meta and model.linear.weight.is_meta

    Scaled.reset_parameters = lambda self: self.linear.reset_parameters()  # leaves scale alone
    with torch.device("meta"):
        model = Scaled()
    with pytest.raises(ValueError, match="buffer scale of a model built on the meta device has no values"):
        tierwise.setup(model, torch.optim.AdamW(model.parameters()), device="cpu")
    assert model.scale.is_meta and model.linear.weight.is_meta
