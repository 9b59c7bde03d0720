"""Page-locked host memory is budgeted and counted (issue 28, defect 5): the activation swaps'
pinned buffers are one Config field (``pinned_memory``) reserved in the host tier, and host slabs
on CUDA are slices of one registered arena counted whole ([Note: one pinned arena]) instead of
blocks of PyTorch's power-of-two pinned allocator ([Note: page-locked slabs]). CPU runs use a stand-in for the CUDA runtime that
records the registrations (pinning switched off: nothing is really locked)."""

from __future__ import annotations

import pytest
import torch
from helpers.fake_cudart import install_fake_cudart
from tierwise.config import Config, ConfigError
from tierwise.runtime.activations.pinned_pool import PINNED_POOL_BYTES, pinned_swap_bytes
from tierwise.runtime.step.host_updates import HostUpdates
from tierwise.tiers import HostTier, PayloadKind, TierBudgetError
from tierwise.tiers.arena import PAGE, SLAB_ALIGNMENT


@pytest.fixture
def cudart(monkeypatch):
    return install_fake_cudart(monkeypatch)


def _registered_bytes(cudart) -> int:
    return sum(cudart.registered.values())


def _slabs_are_disjoint_and_inside_the_registrations(slabs, cudart) -> None:
    spans = sorted((s.tensor.data_ptr(), s.tensor.data_ptr() + s.nbytes) for s in slabs)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))
    for start, end in spans:
        assert any(a <= start and end <= a + n for a, n in cudart.registered.items())


def test_host_slabs_on_cuda_are_slices_of_one_registered_arena(cudart):
    """[Note: one pinned arena]: setup announces its slabs (check_capacity); the tier registers
    one extent for all of them, counted whole; freed room is reused without a registration."""
    tier = HostTier(device=torch.device("cuda"), budget=None, config=Config(device="cpu"))
    assert tier.pin
    sizes = [
        (5000, torch.float32),
        (777, torch.bfloat16),
        (3, torch.float32),
        (1 << 16, torch.bfloat16),
    ]
    nbytes = [n * dtype.itemsize for n, dtype in sizes]
    tier.check_capacity(nbytes)
    slabs = [tier.allocate(n, dtype, kind=PayloadKind.MASTER) for n, dtype in sizes]
    assert cudart.calls == ["register"]
    expected = -(-sum(-(-b // SLAB_ALIGNMENT) * SLAB_ALIGNMENT for b in nbytes) // PAGE) * PAGE
    assert tier.used_bytes == _registered_bytes(cudart) == expected
    assert expected < sum(nbytes) + len(nbytes) * SLAB_ALIGNMENT + PAGE  # no power-of-two rounding
    _slabs_are_disjoint_and_inside_the_registrations(slabs, cudart)
    for slab in slabs:  # usable memory, each slab its own
        assert slab.tensor.shape == (slab.numel,) and slab.tensor.data_ptr() % SLAB_ALIGNMENT == 0
        slab.tensor.fill_(slab.numel)
    assert all(bool((s.tensor == s.numel).all()) for s in slabs)
    tier.release(slabs[1])
    tier.release(slabs[0])  # neighbours merge: room for one slab as large as both
    again = tier.allocate(5000 * 4 + 777 * 2, torch.uint8, kind=PayloadKind.PARAM_CHUNK)
    assert cudart.calls == ["register"] and tier.used_bytes == expected
    _slabs_are_disjoint_and_inside_the_registrations([again, *slabs[2:]], cudart)
    tier.close()
    assert cudart.calls == ["register", "unregister"] and cudart.registered == {}


def test_an_arena_that_is_full_grows_by_exactly_the_slab_within_the_budget(cudart):
    """Without check_capacity (or past it) the arena registers one more extent of the slab's own
    pages, no more; over the budget it refuses and registers nothing (issue 36: it used to grow
    by its whole size)."""
    budget = 40 * PAGE
    tier = HostTier(device=torch.device("cuda"), budget=budget, config=Config(device="cpu"))
    first = tier.allocate(3 * PAGE, torch.uint8, kind=PayloadKind.MASTER)
    assert tier.used_bytes == _registered_bytes(cudart) == 3 * PAGE
    second = tier.allocate(PAGE - 100, torch.uint8, kind=PayloadKind.MASTER)
    assert cudart.calls == ["register", "register"]
    assert tier.used_bytes == _registered_bytes(cudart) == 4 * PAGE  # one page more, not 3
    third = tier.allocate(30 * PAGE, torch.uint8, kind=PayloadKind.MASTER)
    assert tier.used_bytes == _registered_bytes(cudart) == 34 * PAGE
    with pytest.raises(TierBudgetError, match="host tier"):
        tier.allocate(7 * PAGE, torch.uint8, kind=PayloadKind.MASTER)
    assert len(cudart.calls) == 3 and tier.used_bytes == _registered_bytes(cudart) == 34 * PAGE
    tier.release(first)  # its room is reused without a registration
    fourth = tier.allocate(2 * PAGE, torch.uint8, kind=PayloadKind.MASTER)
    assert len(cudart.calls) == 3
    last = tier.allocate(6 * PAGE, torch.uint8, kind=PayloadKind.MASTER)  # exactly the rest
    assert tier.used_bytes == _registered_bytes(cudart) == budget
    _slabs_are_disjoint_and_inside_the_registrations([second, third, fourth, last], cudart)
    tier.close()
    assert cudart.registered == {}


def test_a_small_slab_after_setup_registers_its_own_pages_and_reserve_still_works(cudart):
    """Issue 36: after setup sized the arena (256 MiB here), a 1 MiB slab (the first accumulated
    gradient, a re-layout) registered a second 256 MiB and locked the budget's whole room, so
    every later ``reserve`` (save buffers, undo copies) failed. Now it registers 1 MiB, and a
    reserve of what is left in the budget succeeds."""
    arena = 256 << 20
    budget = arena + (64 << 20)
    tier = HostTier(device=torch.device("cuda"), budget=budget, config=Config(device="cpu"))
    tier.check_capacity([arena])
    setup_slab = tier.allocate(arena, torch.uint8, kind=PayloadKind.MASTER)
    late = tier.allocate(1 << 20, torch.uint8, kind=PayloadKind.GRAD_SHARD)
    assert sorted(cudart.registered.values()) == [1 << 20, arena]
    assert tier.used_bytes == _registered_bytes(cudart) == arena + (1 << 20)
    undo = HostUpdates(tier)  # in-backward host updates' undo copies fit again
    assert undo.reserve_undo([torch.empty(1 << 20, dtype=torch.uint8)])
    undo.release()
    left = budget - tier.used_bytes
    tier.reserve(left, kind=PayloadKind.STAGING, what="the save buffers")  # all the room left
    with pytest.raises(TierBudgetError):
        tier.reserve(1, kind=PayloadKind.STAGING)
    tier.unreserve(left)
    _slabs_are_disjoint_and_inside_the_registrations([setup_slab, late], cudart)
    assert tier.arena_pool in tier.memory_pools()
    assert tier.arena_pool.entry()["bytes"] == _registered_bytes(cudart)
    tier.close()
    assert cudart.registered == {}


def test_host_slabs_without_cuda_are_plain_memory(cudart):
    tier = HostTier(device=torch.device("cpu"), budget=None, config=Config(device="cpu"))
    slab = tier.allocate(1000, torch.float32, kind=PayloadKind.MASTER)
    tier.release(slab)
    assert cudart.calls == []


def test_pinned_memory_is_a_byte_budget():
    assert Config(pinned_memory="256MiB").pinned_memory == 256 << 20
    assert Config().pinned_memory is None
    with pytest.raises(ConfigError, match="pinned_memory"):
        Config(pinned_memory="lots")


def test_the_swap_buffers_budget_applies_on_cuda_when_blocks_swap():
    swaps = {"model.layers.0": "host", "model.layers.1": "keep"}
    assert pinned_swap_bytes(Config(device="cuda", pinned_memory="64MiB"), swaps) == 64 << 20
    assert pinned_swap_bytes(Config(device="cuda"), swaps) == PINNED_POOL_BYTES
    assert pinned_swap_bytes(Config(device="cuda"), {"model.layers.0": "recompute"}) == 0
    assert pinned_swap_bytes(Config(device="cpu", pinned_memory="64MiB"), swaps) == 0
