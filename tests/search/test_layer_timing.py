"""Profile.layer_forward_s as tierwise-profiler fills it for the search's compute term."""

from __future__ import annotations

import pytest

pytest.importorskip("tierwise_search")
pytest.importorskip("tierwise_profiler")
pytestmark = pytest.mark.combined  # search + profiler

import torch  # noqa: E402
from tierwise import Config  # noqa: E402
from tierwise.plugins import get_plugin_host  # noqa: E402
from tierwise_profiler import op_timing  # noqa: E402
from tierwise_profiler.model_profile import profile_model  # noqa: E402


class Twice(torch.nn.Module):
    """``once`` and ``twice`` are identical Linear layers; ``twice`` runs two times per forward."""

    def __init__(self):
        super().__init__()
        self.once = torch.nn.Linear(96, 96)
        self.twice = torch.nn.Linear(96, 96)
        self.norm = torch.nn.LayerNorm(96)

    def forward(self, x):
        return self.norm(self.twice(self.twice(self.once(x))))


def test_each_layer_gets_the_time_of_its_ops_and_repeats_count():
    profile = profile_model(
        Twice(), torch.randn(8, 96), precision="fp32", device="cpu", time_layers=True
    )
    times = profile.layer_forward_s
    assert set(profile.layer_flops) <= set(times)
    assert {"once", "twice", "norm"} <= set(times)
    assert all(seconds > 0 for name, seconds in times.items() if name in ("once", "twice", "norm"))
    # same op signatures, timed once: the layer called twice costs exactly two calls
    assert times["twice"] == 2 * times["once"]


def test_the_engine_hook_times_layers_and_a_plain_profile_does_not():
    model, batch = Twice(), torch.randn(8, 96)
    assert profile_model(model, batch, precision="fp32", device="cpu").layer_forward_s == {}
    hooked = get_plugin_host().profile_model(
        model=model, example_batch=batch, config=Config(device="cpu", precision="fp32")
    )
    assert hooked.layer_forward_s.keys() >= {"once", "twice", "norm"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_no_times_for_a_device_this_machine_lacks():
    profile = profile_model(
        Twice(), torch.randn(8, 96), precision="fp32", device="cuda", time_layers=True
    )
    assert profile.layer_flops and profile.layer_forward_s == {}


def test_no_times_when_the_made_up_inputs_would_be_too_large(monkeypatch):
    monkeypatch.setattr(op_timing, "REPLAY_MAX_BYTES", 1000)
    profile = profile_model(
        Twice(), torch.randn(8, 96), precision="fp32", device="cpu", time_layers=True
    )
    assert profile.layer_flops and profile.layer_forward_s == {}


def test_an_op_the_real_kernel_refuses_means_no_times():
    # bf16 parameters and an fp32 batch: the fake kernels let the mixed dtypes through, the real
    # addmm refuses them (as the real forward would)
    profile = profile_model(Twice(), torch.randn(8, 96), precision="bf16", time_layers=True)
    assert profile.layer_flops and profile.layer_forward_s == {}


def test_each_layer_gets_a_measured_backward_and_a_frozen_weight_needs_no_gradient():
    """[Note: backward timing]: autograd's backward of each forward op, with the inputs that
    required a gradient in the step; a frozen layer's weight is recorded as needing none."""
    model = Twice()
    model.once.requires_grad_(False)
    profile = profile_model(
        model, torch.randn(8, 96), precision="fp32", device="cpu", time_layers=True
    )
    backward = profile.layer_backward_s
    assert {"once", "twice", "norm"} <= set(backward)
    assert backward["twice"] > 0 and backward["norm"] > 0
    assert set(backward) == set(profile.layer_forward_s)
    # once is frozen and its input is the batch (no gradient): nothing to run backward for
    assert backward["once"] == 0


def test_the_search_takes_the_measured_backward():
    from tierwise.hardware import Hardware
    from tierwise_search.compute import layer_times
    from tierwise_search.rates import resolve_rates

    profile = profile_model(
        Twice(), torch.randn(8, 96), precision="fp32", device="cpu", time_layers=True
    )
    times = layer_times(profile, resolve_rates(Hardware(device_type="cpu")).compute)
    assert times.backward == pytest.approx(sum(profile.layer_backward_s.values()))
    assert "measured per layer" in times.source
