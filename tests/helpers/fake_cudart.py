"""A stand-in for the CUDA runtime's page-locking calls on CPU-only machines: it records every
``cudaHostRegister`` / ``cudaHostUnregister`` and answers success (nothing is really locked)."""

from __future__ import annotations

import torch
from tierwise.tiers.arena import PAGE


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

    @property
    def registered_bytes(self) -> int:
        return sum(self.registered.values())


def install_fake_cudart(monkeypatch) -> FakeCudart:
    """Make ``torch.cuda.cudart()`` the stand-in for this test."""
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    return fake
