"""Page-locked host memory is budgeted and counted (issue 28, defect 5): the activation swaps'
pinned buffers are one Config field (``pinned_memory``) reserved in the host tier, and host slabs
on CUDA are registered for exactly their pages instead of taken from PyTorch's power-of-two
pinned allocator ([Note: page-locked slabs]). CPU runs use a stand-in for the CUDA runtime that
records the registrations (pinning switched off: nothing is really locked)."""

from __future__ import annotations

import pytest
import torch
from tierwise.config import Config, ConfigError
from tierwise.runtime.host_buffers import PINNED_POOL_BYTES, pinned_swap_bytes
from tierwise.tiers import HostTier, PayloadKind
from tierwise.tiers.memory import PAGE


class FakeCudart:
    """Records cudaHostRegister / cudaHostUnregister and answers success (0)."""

    def __init__(self):
        self.registered: dict[int, int] = {}
        self.calls: list[str] = []

    def cudaHostRegister(self, address, nbytes, flags):
        self.calls.append("register")
        assert address % PAGE == 0 and nbytes % PAGE == 0 and flags == 0
        self.registered[address] = nbytes
        return 0

    def cudaHostUnregister(self, address):
        self.calls.append("unregister")
        del self.registered[address]
        return 0


@pytest.fixture
def cudart(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    return fake


def test_host_slabs_on_cuda_are_registered_for_exactly_their_pages(cudart):
    tier = HostTier(device=torch.device("cuda"), budget=None, config=Config(device="cpu"))
    assert tier.pin
    numel = 5000  # 20000 bytes: 5 pages; a power-of-two allocator would lock 32 KiB
    slab = tier.allocate(numel, torch.float32, kind=PayloadKind.MASTER, what="master 0")
    assert tier.used_bytes == slab.nbytes == numel * 4
    assert list(cudart.registered.values()) == [-(-slab.nbytes // PAGE) * PAGE]
    (address,) = cudart.registered
    assert slab.tensor.data_ptr() == address and slab.tensor.shape == (numel,)
    slab.tensor.copy_(torch.arange(numel, dtype=torch.float32))  # usable memory
    tier.release(slab)
    assert cudart.calls == ["register", "unregister"] and tier.used_bytes == 0


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
