"""Activation swaps on CUDA take their pinned host buffers from the manager's bounded pool
([Note: bounded pinned buffers] in tierwise.runtime.host_buffers): the gradients are those of
the plain model whether the pool is large enough or far too small (then swaps fall back to
unpinned buffers, counted), the pool never holds more than its budget, and every buffer is back
between steps. The pool's own logic is tested on CPU in tests/core/test_host_buffers.py."""

from __future__ import annotations

import pytest
import torch
from helpers.devices import ONLY_CUDA, deterministic
from tierwise.runtime.activations import ActivationManager, find_blocks

WIDTH, ROWS, DEPTH = 512, 256, 4
BLOCK_BYTES = 2 * ROWS * WIDTH * 4  # each block saves its input and its tanh output, fp32


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return torch.tanh(self.linear(x))


class Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(Block() for _ in range(DEPTH))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def _gradients(device, policy=None, pinned_bytes=None):
    model = Stack().to(device)
    manager = None
    if policy is not None:
        blocks = find_blocks(model)
        manager = ActivationManager(
            model=model,
            blocks=blocks,
            policy={name: policy for name in blocks},
            device=torch.device(device),
            pinned_bytes=pinned_bytes,
        )
        manager.install()
    x = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(1)).to(device)
    for _ in range(2):  # the second step reuses the pool's buffers
        model.zero_grad()
        model(x).backward()
        if manager is not None:
            manager.end_step()
            assert manager.stats()["host_buffers"]["lent_bytes"] == 0
    grads = {name: p.grad.cpu() for name, p in model.named_parameters()}
    stats = manager.stats() if manager is not None else None
    if manager is not None:
        manager.close()
    return grads, stats


@pytest.mark.parametrize("device", ONLY_CUDA)
@pytest.mark.parametrize("pinned_bytes", [64 << 20, BLOCK_BYTES], ids=["ample", "tiny"])
def test_host_swaps_through_the_bounded_pinned_pool_leave_the_gradients(device, pinned_bytes):
    with deterministic(device):
        reference, _ = _gradients(device)
        grads, stats = _gradients(device, "host", pinned_bytes)
    assert all(torch.equal(grads[k], reference[k]) for k in reference)
    pool = stats["host_buffers"]
    assert stats["swapped_out_bytes"]["host"] == DEPTH * BLOCK_BYTES
    assert 0 < pool["high_water_bytes"] <= pinned_bytes
    if pinned_bytes >= DEPTH * BLOCK_BYTES:
        assert pool["unpinned_bytes"] == 0 and pool["refused"] == 0
    else:  # most swaps did not fit: unpinned, counted, and the pool stayed within its budget
        assert pool["unpinned_bytes"] > 0 and pool["refused"] > 0
