"""The profile hook through the plugin host: results, None without a batch, fallback warnings."""

from __future__ import annotations

import pytest

pytest.importorskip("tierwise_profiler")

import torch  # noqa: E402
from helpers.models import tiny_batch, tiny_model  # noqa: E402
from tierwise.config import Config  # noqa: E402
from tierwise.plugins import get_plugin_host  # noqa: E402
from tierwise_profiler import ProfilerFallbackWarning  # noqa: E402


class ScaleByMax(torch.nn.Module):
    """Normalises by a Python float taken from the data: needs values."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        scale = x.abs().max().item()
        return self.linear(x / scale).sum()


class KeepPositive(torch.nn.Module):
    """Boolean-mask indexing: the output shape depends on values."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x[x[:, 0] > 0]).sum()


class AsList(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        sizes = x[:, 0].long().tolist()
        return self.linear(x).sum() * len(sizes)


def profile_through_host(model, batch, **config):
    return get_plugin_host().profile_model(
        model=model, example_batch=batch, config=Config(device="cpu", **config)
    )


def test_hook_profiles_with_the_configured_precision_and_checkpointing():
    model = tiny_model("gpt2")
    profile = profile_through_host(
        model, tiny_batch(), precision="fp32", activation_checkpointing=True
    )
    assert profile.source == "meta"
    assert len(profile.checkpoint_blocks) == model.config.n_layer
    bf16 = profile_through_host(model, tiny_batch())
    assert bf16.peak_activation_bytes < profile.peak_activation_bytes * 2
    assert bf16.checkpoint_blocks == []


def test_hook_returns_none_without_a_batch():
    assert profile_through_host(tiny_model("gpt2"), None) is None


@pytest.mark.parametrize(
    ("model", "op", "hint"),
    [
        (ScaleByMax(), "aten._local_scalar_dense", "item()"),
        (AsList(), "aten._local_scalar_dense", ".tolist()"),
        (KeepPositive(), "aten.index -> aten.nonzero", "boolean-mask indexing"),
    ],
    ids=["item", "tolist", "mask"],
)
def test_value_dependent_forward_warns_naming_the_op_and_returns_none(model, op, hint):
    with pytest.warns(ProfilerFallbackWarning) as caught:
        result = profile_through_host(model, torch.randn(3, 4))
    assert result is None
    message = str(caught[0].message)
    assert op in message and hint in message
    assert f"{__file__}:" in message  # the model line that needed values
    assert type(model).__name__ in message and "warm-up trace" in message
    assert all(p.device.type == "cpu" for p in model.parameters())  # restored
    model(torch.randn(3, 4)).backward()  # and still trains


def test_engine_setup_falls_back_and_trains_when_the_profile_cannot_run():
    import tierwise

    torch.manual_seed(0)
    model = ScaleByMax()
    reference = ScaleByMax()
    reference.load_state_dict(model.state_dict())
    initial = model.linear.weight.detach().clone()
    x = torch.randn(3, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.warns(ProfilerFallbackWarning, match="aten._local_scalar_dense"):
        model, optimizer = tierwise.setup(
            model, optimizer, precision="fp32", device="cpu", example_batch=x
        )
    assert tierwise.engine_of(model).plan is not None
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3, fused=True)
    for _ in range(2):  # trains: forward, backward and step, as fused AdamW does, bitwise
        loss, reference_loss = model(x), reference(x)
        assert torch.equal(loss, reference_loss)
        loss.backward()
        reference_loss.backward()
        optimizer.step()
        reference_optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
    state = model.state_dict()
    for name, value in reference.state_dict().items():
        assert torch.equal(state[name], value), name
    assert not torch.equal(state["linear.weight"], initial)  # it moved


def test_engine_setup_uses_the_profile():
    import tierwise

    model = tiny_model("gpt2")
    batch = tiny_batch()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = tierwise.setup(
        model, optimizer, precision="fp32", device="cpu", example_batch=batch
    )
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss)
    profile = tierwise.engine_of(model).profile  # the engine keeps the profile it planned with
    assert profile.source == "meta"
    assert profile.multi_use == ["transformer.wte.weight"]
