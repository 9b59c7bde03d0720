"""Invariant 1: a plan changes where bytes live and when they move, never the arithmetic."""

import pytest
import torch
from helpers.train import run_tierwise

PLANS = {
    "all-device": dict(param_placement="device", optimizer_placement="device"),
    "host-params-min-cache": dict(param_placement="host", optimizer_placement="device", cache_blocks=2, chunk_size=5000),
    "host-params-2x-cache": dict(param_placement="host", optimizer_placement="device", cache_blocks=4, chunk_size=5000),
    "optimizer-on-host": dict(param_placement="device", optimizer_placement="host"),
    "all-host-prefetch0": dict(param_placement="host", optimizer_placement="host", cache_blocks=3, prefetch=0),
    "all-host-prefetch2": dict(param_placement="host", optimizer_placement="host", cache_blocks=3, prefetch=2),
    "chunk-4096": dict(chunk_size=4096, param_placement="host", optimizer_placement="host", cache_blocks=3),
    "chunk-7777": dict(chunk_size=7777, param_placement="host", optimizer_placement="device", cache_blocks=2),
    "chunk-12345": dict(chunk_size=12345),
    "auto-budget": dict(device_memory=200_000),
}


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
