"""Floating forward inputs follow the compute precision (Config.cast_forward_inputs), as FSDP2's
MixedPrecisionPolicy(cast_forward_inputs=True) casts them: a float32 input meets bf16/fp16
weights. Compared with plain PyTorch running the same model in that dtype on the cast input."""

from __future__ import annotations

import copy

import pytest
import tierwise
import torch
from tierwise.config import Config, ConfigError
from tierwise.precision import compute_dtype


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(16, 32)
        self.second = torch.nn.Linear(32, 4)

    def forward(self, x, *, extra=None, steps=None):
        out = self.second(torch.relu(self.first(x)))
        if extra is not None:  # a nested floating input is cast too; integers are not
            out = out + extra["shift"] * steps.to(out.dtype)
        return out


def _setup(net, **options):
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    return tierwise.setup(net, opt, device="cpu", **options)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_float32_inputs_are_cast_to_the_compute_precision(precision):
    dtype = compute_dtype(precision)
    reference = _Net()
    plain = copy.deepcopy(reference).to(dtype)
    model, opt = _setup(reference, precision=precision)
    try:
        x = torch.randn(8, 16)  # float32, as a data loader gives it
        extra = {"shift": torch.full((4,), 0.5)}
        steps = torch.arange(8).reshape(8, 1)
        out = model(x, extra=extra, steps=steps)
        expected = plain(x.to(dtype), extra={"shift": extra["shift"].to(dtype)}, steps=steps)
        assert out.dtype == dtype
        assert torch.equal(out, expected)
        assert x.dtype == torch.float32 and steps.dtype == torch.int64  # the caller's untouched
        out.float().sum().backward()
        opt.step()
        opt.zero_grad()
    finally:
        tierwise.engine_of(model).close()


def test_without_the_cast_a_float32_input_fails_as_in_plain_pytorch():
    model, _ = _setup(_Net(), precision="bf16", cast_forward_inputs=False)
    try:
        with pytest.raises(RuntimeError, match="dtype"):
            model(torch.randn(8, 16))
    finally:
        tierwise.engine_of(model).close()


def test_fp32_runs_inputs_as_given():
    model, _ = _setup(_Net(), precision="fp32")
    try:
        with pytest.raises(RuntimeError, match="dtype"):  # no cast to fp32 either
            model(torch.randn(8, 16, dtype=torch.float64))
    finally:
        tierwise.engine_of(model).close()


def test_cast_forward_inputs_must_be_a_bool():
    with pytest.raises(ConfigError, match="cast_forward_inputs"):
        Config(cast_forward_inputs="yes")
