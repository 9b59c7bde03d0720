"""Asynchronous copies between pinned host memory and the device are waited for before their
data is used ([Note: pinned copies] in tierwise.tiers.memory, [Note: prefetch overlap] in
tierwise.runtime.residency.loads).

Each copy is made slow: it moves a large tensor and is queued behind seconds' worth of matrix
products on the stream that issues it. Reading the destination without the copy's event then
sees the old contents (zeros here), so a missing or misplaced wait fails the value checks.
On CPU the copies are synchronous and the same checks hold trivially.
"""

import contextlib

import pytest
import torch
from helpers.devices import DEVICES, synchronize
from tierwise.config import Config
from tierwise.runtime.residency.loads import ChunkLoads
from tierwise.tiers import HostTier, PayloadKind

BIG = 64 * 2**20  # elements: 256 MiB of int32 (integers: exact values and sums on every device)


def _numel(device: str) -> int:
    return BIG if device == "cuda" else 2**16


def _delay_current_stream(device: str) -> torch.Tensor:
    """Queue long-running matrix products on the current stream of ``device``; returns a
    int32 scalar that depends on all of them and equals zero (CPU: nothing queued, a plain zero)."""
    if device == "cpu":
        return torch.zeros((), dtype=torch.int32)
    a = torch.randn(8192, 8192, device=device) / 8192
    for _ in range(30):  # fp32 without TF32: tens of milliseconds each; the values shrink to 0
        a = a @ a
    return (a[0, 0] * 0).to(torch.int32)


def _host_tier(device: str) -> HostTier:
    return HostTier(device=torch.device(device), budget=None, config=Config(device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_device_to_host_copy_is_complete_after_wait(device):
    tier = _host_tier(device)
    assert tier.pin == (device == "cuda")
    n = _numel(device)
    slab = tier.allocate(n, torch.int32, kind=PayloadKind.OPTIM_STATE, what="optim_chunk 0")
    slab.tensor.zero_()
    zero = _delay_current_stream(device)
    src = torch.arange(n, dtype=torch.int32, device=device) + zero  # ready only after the delay
    handle = tier.write(slab, src)
    handle.wait()  # host code reads the slab next: wait() must block until the copy is done
    assert handle.done()
    expected = torch.arange(n, dtype=torch.int32)
    assert torch.equal(slab.tensor, expected), "the host slab was read before its copy finished"
    tier.release(slab)


@pytest.mark.parametrize("device", DEVICES)
def test_host_to_device_copy_is_ordered_before_compute(device):
    """The copy is issued on another stream than the compute that reads it, behind a delay on
    that stream: only the handle's wait orders the sum after the copy (on one stream the order
    would hold whatever ``wait`` did, and the test could not fail)."""
    tier = _host_tier(device)
    n = _numel(device)
    slab = tier.allocate(n, torch.int32, kind=PayloadKind.PARAM_CHUNK, what="param_chunk 0")
    slab.tensor.copy_(torch.arange(n, dtype=torch.int32))
    out = torch.zeros(n, dtype=torch.int32, device=device)
    synchronize(device)
    side = torch.Stream(device=device) if device != "cpu" else contextlib.nullcontext()
    with side:
        _delay_current_stream(device)  # the copy queued on the side stream runs after this
        handle = tier.read(slab, out)
    handle.wait()  # the compute stream waits for the copy; the sum below runs after it
    assert int(out.sum(dtype=torch.int64)) == n * (n - 1) // 2
    assert int(out[-1]) == n - 1
    tier.release(slab)


@pytest.mark.parametrize("device", DEVICES)
def test_prefetch_on_the_side_stream_is_finished_before_compute_reads(device):
    """A load issued by ChunkLoads.start runs on the side stream (CUDA); compute may read the
    destination only after finish(). The load is delayed on the side stream itself, so compute
    running ahead of it would read zeros."""
    tier = _host_tier(device)
    loads = ChunkLoads(torch.device(device))
    assert (loads.side_stream is not None) == (device == "cuda")
    n = _numel(device)
    slab = tier.allocate(n, torch.int32, kind=PayloadKind.PARAM_CHUNK, what="param_chunk 0")
    slab.tensor.copy_(torch.arange(n, dtype=torch.int32))
    out = torch.zeros(n, dtype=torch.int32, device=device)
    synchronize(device)

    def issue():
        zero = _delay_current_stream(device)  # inside start: the side stream on CUDA
        return [tier.read(slab, out)], [zero]

    loads.start(("group", 0), issue, collective=False)
    assert ("group", 0) in loads
    loads.finish(("group", 0))
    total = out.sum(dtype=torch.int64)  # queued on the compute stream after finish()
    assert int(total) == n * (n - 1) // 2, "compute read the chunk before its load finished"
    assert int(out[-1]) == n - 1
    loads.close()
    tier.release(slab)
