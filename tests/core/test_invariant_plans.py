"""Invariant 1: a plan changes where bytes live and when they move, never the arithmetic."""

import pytest
import torch
from helpers.plans import PLANS
from helpers.train import run_tierwise


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_every_plan_gives_bitwise_identical_training(kind, precision):
    results = {
        name: run_tierwise(kind, 10, precision=precision, device="cpu", **plan)
        for name, plan in PLANS.items()
    }
    base_losses, base_model = results["all-device"]
    base_params = base_model.state_dict()
    assert len(results) >= 8
    for name, (losses, model) in results.items():
        assert losses == base_losses, f"{name}: losses differ from all-device"
        params = model.state_dict()
        for key, value in base_params.items():
            assert torch.equal(params[key], value), f"{name}: {key} differs"
    moved = results["host-params-min-cache"][1]
    stats = __import__("tierwise").engine_of(moved).stats()
    assert stats["moved_bytes"].get("host->device", 0) > 0
    assert stats["cache_blocks"] == 2
