"""The profile against what the core engine records in its warm-up step ([Note: warm-up tracing])."""

from __future__ import annotations

import pytest

pytest.importorskip("tierwise_profiler")

import tierwise  # noqa: E402
import torch  # noqa: E402
from helpers.models import TINY_KINDS, tiny_batch, tiny_model  # noqa: E402
from tierwise_profiler.model_profile import profile_model  # noqa: E402


def warm_up(kind: str, *, checkpointing: bool = False, batch_size: int = 2, **config):
    """One real training step of a tierwise model; returns (engine, profile of the same batch)."""
    model = tiny_model(kind)
    batch = tiny_batch(batch=batch_size)
    profile = profile_model(model, batch, precision="fp32", activation_checkpointing=checkpointing)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = tierwise.setup(
        model,
        opt,
        device="cpu",
        precision="fp32",
        activation_checkpointing=checkpointing,
        example_batch=batch,
        **config,
    )
    model(**batch).loss.backward()
    opt.step()
    opt.zero_grad()
    return tierwise.engine_of(model), profile, (model, opt, batch)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("kind", TINY_KINDS)
def test_profile_call_order_is_the_order_the_engine_records(kind, checkpointing):
    engine, profile, _ = warm_up(
        kind,
        checkpointing=checkpointing,
        param_placement="host",
        optimizer_placement="host",
        chunk_size=5000,
    )
    assert engine.recorded_order["forward"] == profile.forward_order
    assert engine.recorded_order["backward"] == profile.backward_order


@pytest.mark.parametrize("kind", ["gpt2", "llama", "mixtral"])
def test_warm_up_measurement_replaces_the_estimate(kind):
    engine, profile, (model, opt, batch) = warm_up(
        kind, param_placement="host", optimizer_placement="host", chunk_size=5000
    )
    moments = engine.memory_moments
    measured = max(b for _, b in moments)
    estimate = profile.peak_activation_bytes
    assert abs(measured - estimate) <= 0.2 * estimate
    assert engine.estimated_peak_activation_bytes == estimate
    assert engine.profile.peak_activation_bytes == measured
    assert engine.stats()["non_model_peak_bytes"] == measured
    names = [m for m, _ in moments]
    modules_with_params = [n for n, m in model.named_modules() if list(m.parameters(recurse=False))]
    for name in modules_with_params:
        assert f"forward:{name}" in names
    assert any(m.startswith("backward:") for m in names)
    model(**batch).loss.backward()  # later steps are not traced again
    opt.step()
    assert engine.memory_moments is moments


def test_measured_peak_grows_linearly_with_batch():
    small = max(b for _, b in warm_up("llama", batch_size=2)[0].memory_moments)
    large = max(b for _, b in warm_up("llama", batch_size=4)[0].memory_moments)
    assert 1.6 * small <= large <= 2.4 * small


def test_an_engine_that_never_runs_backward_does_not_leave_its_tracer_behind():
    """The CPU tracer is a dispatch mode: an abandoned warm-up must not stay on the stack."""
    depth = torch._C._len_torch_dispatch_stack()
    first = tiny_model("llama")
    first, _ = tierwise.setup(first, torch.optim.AdamW(first.parameters()), device="cpu")
    first(**tiny_batch())  # records a graph, never runs backward, is dropped
    del first
    second, _, _ = warm_up("llama")  # the next engine to trace stops the abandoned trace
    assert torch._C._len_torch_dispatch_stack() == depth
    assert any(m.startswith("backward:") for m, _ in second.memory_moments)
