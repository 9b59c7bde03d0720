"""Invariant 4 on the device process (issue 36), the CUDA side of tests/core/test_device_budget.py:
training under a device budget a quarter of the model's, and with parameters and optimizer
states on the host, ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` stays
within the plan's device figure plus the activations plain PyTorch's own forward/backward takes
(the plan's transient: ``device_allowance`` counts model data only), and the bytes page-locked
with ``cudaHostRegister`` stay within the host memory the ledger counts."""

from __future__ import annotations

import pytest
import tierwise
import torch
from helpers.devices import ONLY_CUDA
from helpers.models import tiny_model
from helpers.train import train
from test_activation_host_buffers import RecordingCudart
from tierwise.tiers.ledger import peak_bound

FP32 = 4


def _activation_bytes(device) -> int:
    """Device bytes plain PyTorch's forward/backward of the model holds beyond its fp32
    parameters and gradients (its activations, the batch, the loss): measured, not assumed."""
    model = tiny_model("llama").to(device)
    n = sum(p.numel() for p in model.parameters())
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)  # the parameters
    train(model, torch.optim.SGD(model.parameters(), lr=0.0), 1, tierwise_model=False)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before - n * FP32  # less the gradients


@pytest.mark.parametrize("device", ONLY_CUDA)
@pytest.mark.parametrize("placement", ["quarter", "host"])
def test_the_device_peak_and_the_pinned_bytes_stay_within_the_plan(device, placement, monkeypatch):
    transient = _activation_bytes(device)  # first: cuBLAS's workspace is then already there
    model = tiny_model("llama")
    need = sum(p.numel() for p in model.parameters()) * 16  # fp32 params, grads, m, v
    config = (
        {"device_memory": need // 4}
        if placement == "quarter"
        else {"param_placement": "host", "optimizer_placement": "host", "cache_blocks": 2}
    )
    recording = RecordingCudart(torch.cuda.cudart())
    monkeypatch.setattr(torch.cuda, "cudart", lambda: recording)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    model, opt = tierwise.setup(model, opt, precision="fp32", device=device, **config)
    engine = tierwise.engine_of(model)
    try:
        train(model, opt, 2)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        budget = config.get("device_memory", engine.plan.device_allowance)
        assert engine.plan.device_allowance <= budget
        assert peak <= budget + transient
        report = engine.stats()["memory"]
        assert report["device"]["peak_bytes"] <= engine.plan.device_allowance
        assert 0 < recording.peak <= peak_bound(report, "host")
    finally:
        engine.close()
