"""The memory ledger (issue 36, [Note: the memory ledger]): every buffer tierwise allocates
outside the tiers goes through a named pool that counts it, pinned ones are page-locked over
exactly their pages (never PyTorch's power-of-two caching pinned allocator: on this CPU-only
torch a ``pin_memory=True`` allocation raises, so a path still using it fails these tests),
``stats()["memory"]`` reports each tier and pool, and the process's measured peak RSS growth is
within what the ledger counts plus a stated tolerance."""

from __future__ import annotations

import gc
import sys

import pytest
import tierwise
import torch
from helpers.fake_cudart import install_fake_cudart
from helpers.models import tiny_model
from helpers.process_memory import (
    GPT2_PARAMS,
    TOLERANCE,
    assert_within_ledger,
    gpt2_growth,
    linux_peak_resettable,
)
from helpers.train import train
from tierwise.config import Config
from tierwise.runtime.activations.pinned_pool import HostBufferPool
from tierwise.runtime.grads.offload import GradientOffload
from tierwise.runtime.grads.reduce.blocks import BlockPool
from tierwise.runtime.step.home_writes import HomeWrites
from tierwise.tiers import HostTier
from tierwise.tiers.arena import PAGE, round_up
from tierwise.tiers.base import PayloadKind
from tierwise.tiers.ledger import MemoryPool, PoolBudgetError, ReusedBuffers, peak_bound
from tierwise.tiers.memory import DeviceTier

KIB = 1024
FIELDS = {"bytes", "peak_bytes", "budget", "pinned", "memory", "within"}


@pytest.fixture
def cudart(monkeypatch):
    return install_fake_cudart(monkeypatch)


def test_a_pinned_pool_locks_exactly_each_buffers_pages_and_unlocks_them_when_dropped(cudart):
    pool = MemoryPool("p", memory="host", pinned=True, budget=64 * KIB)
    first = pool.empty(5000)
    second = pool.empty(3 * PAGE, torch.uint8)
    wide = pool.empty(1000, torch.float32)
    assert sorted(cudart.registered.values()) == [PAGE, 2 * PAGE, 3 * PAGE]  # no rounding up
    assert pool.bytes == cudart.registered_bytes == 6 * PAGE
    assert first.numel() == 5000 and wide.dtype == torch.float32 and wide.numel() == 1000
    assert all(t.data_ptr() % PAGE == 0 for t in (first, second, wide))
    with pytest.raises(PoolBudgetError, match="memory pool p"):
        pool.empty(64 * KIB)
    assert pool.bytes == cudart.registered_bytes == 6 * PAGE  # refused: nothing locked
    view = first[10:20]
    del first
    gc.collect()
    assert pool.bytes == 6 * PAGE  # a view keeps it
    del view, second, wide
    gc.collect()
    assert pool.bytes == 0 and cudart.registered == {}
    assert pool.peak_bytes == 6 * PAGE


def test_activation_host_buffers_lock_no_more_than_the_pool_holds(cudart):
    capacity = 64 * KIB
    pool = HostBufferPool(capacity, pin=True)
    lent = [pool.take(n) for n in (10 * KIB, 5000, 20 * KIB + 1)]
    held = pool.stats()["held_bytes"]
    assert held == round_up(10 * KIB, PAGE) + round_up(5000, PAGE) + round_up(20 * KIB + 1, PAGE)
    assert cudart.registered_bytes == held == pool.memory.bytes <= capacity
    for buffer in lent:
        pool.give(buffer)
    del lent, buffer  # the borrowers are done with them
    big = pool.take(60 * KIB)  # free buffers are dropped (and unlocked) to make room
    assert cudart.registered_bytes == pool.stats()["held_bytes"] == 60 * KIB <= capacity
    pool.give(big)
    pool.close()
    del big
    gc.collect()
    assert cudart.registered == {} and pool.memory.bytes == 0


class _Chunk:
    """What the gradient offload reads of a chunk (hashable, as chunks are)."""

    def __init__(self, shard_size: int):
        self.shard_size = shard_size
        self.optim = type("Optim", (), {"grad_buffer": None})()


def test_gradient_offload_buffers_are_locked_as_the_host_tier_reserves_them(cudart):
    host = HostTier(device=torch.device("cuda"), budget=None, config=Config(device="cpu"))
    offload = GradientOffload(host=host, numel=3000, dtype=torch.bfloat16, count=2)
    assert host.used_bytes == offload.nbytes == 2 * round_up(3000 * 2, PAGE)
    buffers = [offload.hold(_Chunk(3000), fresh=True) for _ in range(2)]
    assert all(b.dtype == torch.bfloat16 and b.numel() == 3000 for b in buffers)
    assert cudart.registered_bytes == offload.memory.bytes == offload.nbytes
    assert offload.memory.entry()["within"] == "host"  # counted once, in the host tier
    offload.close()
    assert host.used_bytes == 0


def test_reduction_host_buffers_are_locked_and_counted(cudart):
    device_tier = type("DeviceTier", (), {"device": torch.device("cuda")})()
    pool = BlockPool(device_tier, torch.bfloat16, blocks=2)
    pool.block_numel = 5000
    waiting = [pool.host(3000), pool.host(5000)]  # each as large as a block
    assert cudart.registered_bytes == pool.host_memory.bytes == 2 * round_up(5000 * 2, PAGE)
    for buffer in waiting:
        pool.give_host(buffer)
    again = pool.host(4000)  # reused, nothing new locked
    assert len(cudart.registered) == 2
    pool.give_host(again)
    pool.release()
    del waiting, buffer, again
    gc.collect()
    assert cudart.registered == {} and pool.host_memory.bytes == 0


def test_home_write_buffers_are_locked_counted_and_reused(cudart):
    """[Note: reused page-locked buffers]: a device home's new values computed on a worker are
    in a page-locked buffer of the ledger's ``home_write_buffers`` (not PyTorch's pinned cache,
    which raises on this CPU-only torch), handed back once the engine's copy is done and lent
    again without locking more."""
    writes = HomeWrites(pinned=True)
    tier = DeviceTier(device=torch.device("cpu"), budget=None, config=Config(device="cpu"))
    home = tier.allocate(3000, torch.bfloat16, kind=PayloadKind.PARAM_CHUNK)
    master = torch.randn(3000, generator=torch.Generator().manual_seed(0))
    values = writes.host_values(master, torch.bfloat16)
    assert torch.equal(values, master.to(torch.bfloat16))  # rounded as ``.to`` rounds
    assert cudart.registered_bytes == writes.memory.bytes == round_up(3000 * 2, PAGE)
    writes.post(home, values)
    writes.flush()  # issued; the copy is done, so the buffer goes back
    assert torch.equal(home.tensor, master.to(torch.bfloat16))
    again = writes.host_values(master * 2, torch.bfloat16)
    assert again.data_ptr() == values.data_ptr() and len(cudart.registered) == 1  # reused
    writes.post(home, again)
    writes.flush()
    assert torch.equal(home.tensor, (master * 2).to(torch.bfloat16))
    assert writes.memory.peak_bytes == round_up(3000 * 2, PAGE)


def test_reused_buffers_keep_a_bounded_number_free(cudart):
    pool = MemoryPool("reused", memory="host", pinned=True)
    buffers = ReusedBuffers(pool, keep=2)
    taken = [buffers.take(100, torch.int64) for _ in range(5)]
    assert pool.bytes == cudart.registered_bytes == 5 * PAGE
    for buffer in taken:
        buffers.give(buffer)
    del taken, buffer
    gc.collect()
    assert pool.bytes == cudart.registered_bytes == 2 * PAGE  # the rest unlocked and uncounted
    wide = buffers.take(600, torch.int64)  # larger than any free one: one more
    assert wide.numel() == 600 and pool.bytes == 2 * PAGE + round_up(4800, PAGE)


def test_home_writes_of_host_updates_in_backward_are_counted_and_reused():
    """Device homes updated by the host worker during backward: the host values are counted
    in ``home_write_buffers``, at most one per chunk at once plus the few kept free for reuse;
    control data has its entry too (nothing on a CPU)."""
    model, opt, engine = _engine(
        precision="bf16",
        chunk_size=5000,
        param_placement="device",
        optimizer_placement="host",
        optimizer_overlap="in-backward",
    )
    train(model, opt, 4)
    memory = engine.stats()["memory"]
    entry = memory["home_write_buffers"]
    homes = [c.home.nbytes for g in engine.index.groups for c in g.chunks if c.trainable]
    kept = engine.optimizer.updates.home_writes.keep_free * max(homes)
    assert max(homes) <= entry["peak_bytes"] <= sum(homes) + kept
    assert entry["bytes"] <= kept  # after the steps: only the free buffers kept for reuse
    assert not entry["pinned"]  # a CPU run
    assert memory["control_data_buffers"]["bytes"] == 0
    engine.close()


def _engine(**config):
    model = tiny_model("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = tierwise.setup(model, opt, device="cpu", **config)
    return model, opt, tierwise.engine_of(model)


def test_stats_report_every_tier_and_pool_and_low_bit_workspaces_are_freed_after_the_step(
    monkeypatch,
):
    from tierwise.optim import lowbit_kernel

    # the pieces way decodes into workspaces ([Note: fused low-bit update]); the one-pass int8
    # kernel ([Note: int8 Adam in one pass]) takes none, so it is turned off here
    monkeypatch.setattr(lowbit_kernel, "one_pass_width", lambda lib: None)
    model, opt, engine = _engine(
        precision="bf16",
        param_placement="host",
        optimizer_placement="host",
        optimizer_states="int8",
    )
    train(model, opt, 2)
    memory = engine.stats()["memory"]
    assert {"device", "host"} <= set(memory)
    assert all(set(entry) == FIELDS for entry in memory.values())
    assert memory["host"]["bytes"] == engine.tiers["host"].used_bytes
    assert memory["host"]["budget"] == engine.tiers["host"].budget
    workspaces = memory["optimizer_workspaces_host"]
    assert workspaces["peak_bytes"] > 0  # decode buffers and quantize workspaces were used ...
    assert workspaces["bytes"] == 0  # ... and given back after the step
    saved = memory["saved_activations"]
    assert saved["peak_bytes"] == engine.stats()["activations"]["saved_peak_bytes"] > 0
    assert saved["bytes"] == 0  # freed by the backward
    summed = sum(e["peak_bytes"] for e in memory.values() if e["within"] is None)
    assert peak_bound(memory, "host") == summed  # a CPU run: every entry is in host RAM


@pytest.mark.skipif(
    not linux_peak_resettable() or sys.platform != "linux", reason="needs /proc/self/clear_refs"
)
@pytest.mark.parametrize("extra", ["", 'optimizer_states="int8"'])
def test_the_ledger_explains_the_process_peak_rss_growth(extra):
    record = gpt2_growth(
        f'precision="bf16", param_placement="host", optimizer_placement="host", {extra}'
    )
    # the model data is there to explain: bf16 params holding the gradients (2 B) and the fp32
    # master (4 B), with Adam m and v in fp32 (8 B) or int8 (2 B before block scales)
    per_param = 2 + 4 + (2 if "int8" in extra else 8)
    assert record["ledger_host_bound"] > per_param * GPT2_PARAMS
    assert_within_ledger(record, tolerance=TOLERANCE, what=f"setup and 3 steps ({extra})")
