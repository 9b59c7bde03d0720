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
