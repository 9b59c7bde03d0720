"""Activation swaps on CUDA take their pinned host buffers from the manager's bounded pool
([Note: bounded pinned buffers] in tierwise.runtime.activations.pinned_pool): the gradients are those of
the plain model whether the pool is large enough or far too small (then swaps fall back to
unpinned buffers, counted), the pool never holds more than its budget, and every buffer is back
between steps. The pool's own logic is tested on CPU in tests/core/test_host_buffers.py; the
nvme case is in tests/nvme/test_activation_swap.py."""

from __future__ import annotations

import gc

import pytest
import torch
from helpers.block_stack import block_bytes, gradients
from helpers.devices import ONLY_CUDA, deterministic

SHAPE = dict(rows=256, width=512, depth=4)
BLOCK_BYTES = block_bytes(SHAPE["rows"], SHAPE["width"])


@pytest.mark.parametrize("device", ONLY_CUDA)
@pytest.mark.parametrize("pinned_bytes", [64 << 20, BLOCK_BYTES], ids=["ample", "tiny"])
def test_host_swaps_through_the_bounded_pinned_pool_leave_the_gradients(device, pinned_bytes):
    with deterministic(device):
        reference, _ = gradients(device, **SHAPE)
        grads, stats = gradients(device, **SHAPE, policy="host", pinned_bytes=pinned_bytes)
    assert all(torch.equal(grads[k], reference[k]) for k in reference)
    pool = stats["host_buffers"]
    assert stats["swapped_out_bytes"]["host"] == SHAPE["depth"] * BLOCK_BYTES
    assert 0 < pool["high_water_bytes"] <= pinned_bytes
    if pinned_bytes >= SHAPE["depth"] * BLOCK_BYTES:
        assert pool["unpinned_bytes"] == 0 and pool["refused"] == 0
    else:  # most swaps did not fit: unpinned, counted, and the pool stayed within its budget
        assert pool["unpinned_bytes"] > 0 and pool["refused"] > 0


class RecordingCudart:
    """The CUDA runtime, with the bytes page-locked through it counted (issue 36)."""

    def __init__(self, real):
        self.real, self.registered, self.peak = real, {}, 0

    def cudaHostRegister(self, address, nbytes, flags):
        self.registered[address] = nbytes
        self.peak = max(self.peak, sum(self.registered.values()))
        return self.real.cudaHostRegister(address, nbytes, flags)

    def cudaHostUnregister(self, address):
        self.registered.pop(address, None)
        return self.real.cudaHostUnregister(address)


@pytest.mark.parametrize("device", ONLY_CUDA)
def test_swaps_lock_at_most_the_pinned_budget_and_lower_the_device_peak(device, monkeypatch):
    """Invariant 4 on the process (issue 36): the bytes cudaHostRegister'ed for swaps never pass
    ``pinned_memory`` and are unlocked once the pool closes (no PyTorch pinned cache keeps
    them), and the device's peak (``max_memory_allocated`` after ``reset_peak_memory_stats``)
    with every block swapped is no more than the plain model's."""
    recording = RecordingCudart(torch.cuda.cudart())
    monkeypatch.setattr(torch.cuda, "cudart", lambda: recording)
    peaks = {}
    for policy in (None, "host"):
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        kwargs = {} if policy is None else {"policy": policy, "pinned_bytes": 2 * BLOCK_BYTES}
        gradients(device, **SHAPE, **kwargs)
        torch.cuda.synchronize(device)
        peaks[policy] = torch.cuda.max_memory_allocated(device) - before
    gc.collect()
    assert 0 < recording.peak <= 2 * BLOCK_BYTES
    assert recording.registered == {}
    assert peaks["host"] <= peaks[None]


@pytest.mark.parametrize("device", ONLY_CUDA)
@pytest.mark.parametrize("pinned_bytes", [64 << 20, BLOCK_BYTES // 4], ids=["ample", "tiny"])
def test_recompute_from_host_inputs_through_the_pinned_pool_leaves_the_gradients(
    device, pinned_bytes
):
    """``recompute_host`` ([Note: recompute from swapped inputs]): only each block's input
    (rows x width fp32, half a block's saved bytes) goes through the pool; its copies are issued
    on the side stream with events, and the recompute reads the copy back."""
    with deterministic(device):
        reference, _ = gradients(device, **SHAPE)
        grads, stats = gradients(
            device, **SHAPE, policy="recompute_host", pinned_bytes=pinned_bytes
        )
    assert all(torch.equal(grads[k], reference[k]) for k in reference)
    assert stats["swapped_out_bytes"]["host"] == SHAPE["depth"] * BLOCK_BYTES // 2
    assert stats["swapped_in_bytes"] == stats["swapped_out_bytes"]
    assert stats["recomputed_blocks"] == SHAPE["depth"]
    assert 0 < stats["host_buffers"]["high_water_bytes"] <= pinned_bytes
