"""[Note: huge pages for per-step host memory]: a gradient shard's fresh CPU memory is advised
as huge pages; the values a step computes are unchanged."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import tierwise
import torch
from tierwise.tiers.huge_pages import HUGE_PAGE, advise_huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_on() -> bool:
    return sys.platform.startswith("linux") and THP.exists() and "[never]" not in THP.read_text()


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping holding ``address`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not _thp_on(), reason="transparent huge pages are off or not Linux")
def test_fresh_cpu_memory_is_advised_as_huge_pages():
    storage = torch.empty(16 * HUGE_PAGE // 4, dtype=torch.float32).untyped_storage()
    inside = (storage.data_ptr() + 2 * HUGE_PAGE) & ~(HUGE_PAGE - 1)
    assert "hg" not in _vm_flags(inside)
    advise_huge_pages(storage)
    assert "hg" in _vm_flags(inside)


def test_small_and_empty_storages_are_left_alone():
    for numel in (0, 10, HUGE_PAGE // 4):
        storage = torch.ones(numel).untyped_storage()
        advise_huge_pages(storage)
        assert bytes(storage) == bytes(torch.ones(numel).untyped_storage())


def test_host_gradient_shards_train_bitwise_as_plain_pytorch(monkeypatch):
    """Parameters, gradients and states on host (the shard gives its pages back at zero_grad,
    advised as huge pages for when the kernel takes them: [Note: gradient memory between
    steps]): bitwise plain PyTorch's fused AdamW over three steps, and the hint was given for
    the shard's memory each step."""
    advised = []
    import tierwise.chunks.chunk as chunk_module

    def counting(storage):
        advised.append(storage.nbytes())
        advise_huge_pages(storage)

    monkeypatch.setattr(chunk_module, "advise_huge_pages", counting)

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512)
        )

    data = [torch.randn(8, 512, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    plain = model()
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, fused=True)
    for x in data:
        plain(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    managed = model()
    opt = torch.optim.AdamW(managed.parameters(), lr=1e-3)
    managed, opt = tierwise.setup(
        managed,
        opt,
        precision="fp32",
        device="cpu",
        param_placement="host",
        optimizer_placement="host",
        cache_blocks=2,
    )
    for x in data:
        managed(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    trained = managed.state_dict()  # between steps a cached chunk's values are in its home
    for name, value in plain.state_dict().items():
        assert torch.equal(value, trained[name]), name
    assert len(advised) >= len(data) and all(n > 0 for n in advised)
