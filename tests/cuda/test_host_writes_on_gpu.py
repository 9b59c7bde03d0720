"""Issue 37 on a GPU: the reducer's copies into host memory queued without blocking and landed
once ([Note: reduced gradients land per due point]), and the page-locked buffers of home writes
and control reads drawn through the ledger ([Note: reused page-locked buffers]) instead of
PyTorch's caching host allocator. The CPU side is tests/core/test_step_syncs.py and
tests/core/test_memory_ledger.py; every test here is skipped with a reason where there is no
GPU."""

from __future__ import annotations

import pytest
import tierwise
import torch
from helpers.devices import ONLY_CUDA
from helpers.models import tiny_batch, tiny_model
from tierwise.parallel.collectives import Collectives
from tierwise.runtime.grads.host_writes import HostWrites
from tierwise.tiers.arena import PAGE
from tierwise.tiers.ledger import MemoryPool

BUSY_CYCLES = 200_000_000
"""``torch.cuda._sleep`` cycles queued ahead of the copies: they cannot be done when the host
looks, unless something waited for the stream."""


def _pinned(numel, dtype):
    return MemoryPool("test", memory="host", pinned=True).empty(numel, dtype)


@pytest.mark.parametrize("device", ONLY_CUDA)
def test_reduced_shards_land_into_host_memory_with_one_wait(device):
    """Copies and additions of reduced shards into page-locked host memory are queued behind
    work still running on the stream and return at once; the landing waits once and then gives
    what blocking copies and host adds give, bitwise."""
    gen = torch.Generator().manual_seed(0)
    shards = [torch.randn(4096, generator=gen).to(device) for _ in range(4)]
    held = [torch.randn(4096, generator=gen) for _ in range(2)]
    targets = [_pinned(4096, torch.float32) for _ in range(4)]
    for target, values in zip(targets[2:], held, strict=True):
        target.copy_(values)
    scratch = []

    def take(numel):
        scratch.append(_pinned(numel, torch.float32))
        return scratch[-1]

    writes = HostWrites(scratch=take, give_back=lambda buffer: None)
    torch.cuda._sleep(BUSY_CYCLES)
    writes.copy(targets[0], shards[0], on_host=True)
    writes.copy(targets[1], shards[1], on_host=True)
    writes.add(targets[2], shards[2], on_host=True)
    writes.add(targets[3], shards[3], on_host=True)
    assert writes.pending and writes.waits == 0
    assert torch.equal(targets[2], held[0]), "added before the landing"
    writes.land()
    assert writes.waits == 1 and not writes.pending and len(scratch) == 2
    assert torch.equal(targets[0], shards[0].cpu()) and torch.equal(targets[1], shards[1].cpu())
    for target, values, shard in zip(targets[2:], held, shards[2:], strict=True):
        assert torch.equal(target, values + shard.cpu())


@pytest.mark.parametrize("device", ONLY_CUDA)
def test_control_reads_reuse_one_counted_page_locked_buffer(device):
    """A control read lands in a buffer of the ``control_data_buffers`` pool (page-locked,
    counted), given back once read and lent to the next read."""
    collectives = Collectives(torch.device(device, torch.cuda.current_device()))
    pool = collectives.control_buffers.pool
    assert pool.pinned
    for round_ in range(3):
        values = torch.arange(10, dtype=torch.int64, device=device) * round_
        assert collectives.read_back(values).values() == (values.cpu()).tolist()
    assert pool.bytes == pool.peak_bytes == PAGE  # one buffer, reused


@pytest.mark.parametrize("device", ONLY_CUDA)
def test_home_writes_use_no_pinned_memory_outside_the_ledger(device, monkeypatch):
    """Device homes updated by the host worker in backward: no ``pin_memory`` allocation from
    PyTorch's caching host allocator during the steps; the host values are counted in the
    page-locked ``home_write_buffers`` and reused from step to step."""
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    model, opt = tierwise.setup(
        model,
        opt,
        device=device,
        chunk_size=5000,
        param_placement="device",
        optimizer_placement="host",
        optimizer_overlap="in-backward",
    )
    engine = tierwise.engine_of(model)
    cached_pins = []
    empty, pin_memory = torch.empty, torch.Tensor.pin_memory

    def counted_empty(*args, **kwargs):
        if kwargs.get("pin_memory"):
            cached_pins.append("torch.empty(pin_memory=True)")
        return empty(*args, **kwargs)

    def counted_pin_memory(tensor, *args, **kwargs):
        cached_pins.append("Tensor.pin_memory")
        return pin_memory(tensor, *args, **kwargs)

    peaks = []
    for step in range(4):
        if step == 1:  # after the warm-up step and its re-layout
            monkeypatch.setattr(torch, "empty", counted_empty)
            monkeypatch.setattr(torch.Tensor, "pin_memory", counted_pin_memory)
        batch = {k: v.to(device) for k, v in tiny_batch(seed=step).items()}
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
        peaks.append(engine.stats()["memory"]["home_write_buffers"]["peak_bytes"])
    monkeypatch.undo()
    entry = engine.stats()["memory"]["home_write_buffers"]
    engine.close()
    assert cached_pins == []
    assert entry["pinned"] and peaks[1] > 0
    assert peaks[-1] == peaks[1]  # reused: the peak does not grow


@pytest.mark.parametrize("device", ONLY_CUDA)
def test_uploads_are_queued_and_their_host_buffers_kept_until_the_landing(device):
    """The reducer's host-to-device copies (a launch from host staging, a late buffer, a
    ``no_sync`` sum: [Note: reduced gradients land per due point]) are queued behind work still
    running on the stream and return at once; the host buffer's give-back waits for the
    landing, whose one wait covers them; then the device holds the values, bitwise."""
    gen = torch.Generator().manual_seed(1)
    sources = [
        _pinned(4096, torch.float32).copy_(torch.randn(4096, generator=gen)) for _ in range(3)
    ]
    targets = [torch.empty(4096, device=device) for _ in range(3)]
    given_back = []
    writes = HostWrites(
        scratch=lambda numel: _pinned(numel, torch.float32), give_back=lambda buffer: None
    )
    torch.cuda._sleep(BUSY_CYCLES)
    for i, (target, source) in enumerate(zip(targets, sources, strict=True)):
        assert writes.upload(target, source, then=lambda i=i: given_back.append(i)) is target
    assert writes.pending and writes.waits == 0 and given_back == []
    writes.land()
    assert writes.waits == 1 and not writes.pending and given_back == [0, 1, 2]
    for target, source in zip(targets, sources, strict=True):
        assert torch.equal(target.cpu(), source)


@pytest.mark.parametrize("device", ONLY_CUDA)
def test_device_home_writes_are_queued_and_their_values_kept_until_done(device):
    """[Note: writes from host memory]: a device home's new values in a page-locked buffer are
    copied without blocking (``DeviceTier.write``): the flush returns while the copy waits behind
    work on the stream, so the buffer is not lent again for the next values; once the copy is
    done it is, and the home holds what was written, bitwise. Before, the copy blocked and the
    buffer was lent again at once."""
    from tierwise.config import Config
    from tierwise.runtime.step.home_writes import HomeWrites
    from tierwise.tiers.base import PayloadKind
    from tierwise.tiers.memory import DeviceTier

    cuda = torch.device(device, torch.cuda.current_device())
    tier = DeviceTier(device=cuda, budget=None, config=Config(device=device))
    home = tier.allocate(4096, torch.bfloat16, kind=PayloadKind.PARAM_CHUNK)
    writes = HomeWrites(pinned=True)
    master = torch.randn(4096, generator=torch.Generator().manual_seed(2))
    values = writes.host_values(master, torch.bfloat16)
    torch.cuda._sleep(BUSY_CYCLES)
    writes.post(home, values)
    writes.flush()
    again = writes.host_values(master * 2, torch.bfloat16)
    assert again.data_ptr() != values.data_ptr(), "lent again while its copy was queued"
    torch.cuda.synchronize()
    assert torch.equal(home.tensor.cpu(), master.to(torch.bfloat16))
    writes.post(home, again)
    writes.flush()  # the first copy is done: its buffer goes back
    torch.cuda.synchronize()
    writes.flush()
    assert torch.equal(home.tensor.cpu(), (master * 2).to(torch.bfloat16))
    third = writes.host_values(master, torch.bfloat16)
    assert third.data_ptr() in (values.data_ptr(), again.data_ptr())  # reused, none locked
    tier.release(home)


@pytest.mark.parametrize("device", ONLY_CUDA)
def test_control_uploads_reuse_one_counted_page_locked_buffer(device, monkeypatch):
    """The upload half of ``control_data_buffers``: control data goes up from a page-locked
    buffer of the pool, kept while its copy is queued and lent again once it is done."""
    from tierwise.parallel import collectives as layer

    cuda = torch.device(device, torch.cuda.current_device())

    class OnTheGPU(layer.TorchDistributed):
        def device(self, group, compute):
            return cuda

    monkeypatch.setattr(layer, "BACKEND", OnTheGPU())
    collectives = Collectives(cuda)
    pool = collectives.control_buffers.pool
    torch.cuda._sleep(BUSY_CYCLES)
    first = collectives.upload([1, 0, 1], torch.int64, None)
    second = collectives.upload([7, 8], torch.int64, None)  # the first copy still queued
    assert pool.bytes == 2 * PAGE
    torch.cuda.synchronize()
    for round_ in range(4):
        assert collectives.upload([round_] * 5, torch.int64, None).tolist() == [round_] * 5
    assert first.tolist() == [1, 0, 1] and second.tolist() == [7, 8]
    assert pool.pinned and pool.bytes == pool.peak_bytes == 2 * PAGE
