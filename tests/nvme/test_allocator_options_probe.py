"""Extent allocator against brute force, option parsing, and the probe hook."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("tierwise_nvme")

from tierwise_nvme.allocator import ExtentAllocator  # noqa: E402
from tierwise_nvme.options import NVMeOptions, NVMeOptionsError  # noqa: E402


def test_allocator_matches_a_byte_map():
    rng = random.Random(0)
    allocator = ExtentAllocator()
    owner = []  # brute force: one entry per 4 KiB page, None when free
    live: dict[int, int] = {}
    for _ in range(2000):
        if live and rng.random() < 0.45:
            offset, pages = live.popitem() if rng.random() < 0.5 else rng.choice(list(live.items()))
            live.pop(offset, None)
            allocator.free(offset * 4096, pages * 4096)
            owner[offset : offset + pages] = [None] * pages
            continue
        pages = rng.randint(1, 16)
        offset = allocator.allocate(pages * 4096)
        if offset is None:
            allocator.grow(allocator.size + pages * 4096 - allocator.tail_free())
            owner.extend([None] * (allocator.size // 4096 - len(owner)))
            offset = allocator.allocate(pages * 4096)
        page = offset // 4096
        assert offset % 4096 == 0
        assert owner[page : page + pages] == [None] * pages  # never hands out used room
        # first fit: no earlier free run was long enough
        run = 0
        for index in range(page):
            run = run + 1 if owner[index] is None else 0
            assert run < pages
        owner[page : page + pages] = [offset] * pages
        live[page] = pages
    assert allocator.free_bytes == owner.count(None) * 4096
    for offset, pages in list(live.items()):
        allocator.free(offset * 4096, pages * 4096)
    assert allocator.allocate(allocator.size) == 0  # everything merged back into one extent


def test_allocator_rejects_double_free():
    allocator = ExtentAllocator()
    allocator.grow(8192)
    offset = allocator.allocate(4096)
    allocator.free(offset, 4096)
    with pytest.raises(ValueError, match="released twice"):
        allocator.free(offset, 4096)


def test_options_from_env_and_validation(monkeypatch):
    monkeypatch.setenv("TIERWISE_NVME_BACKEND", "Threads")
    monkeypatch.setenv("TIERWISE_NVME_BLOCK_SIZE", "4MiB")
    monkeypatch.setenv("TIERWISE_NVME_QUEUE_DEPTH", "16")
    assert NVMeOptions.from_env() == NVMeOptions(
        backend="threads", block_size=4 << 20, queue_depth=16
    )
    with pytest.raises(NVMeOptionsError, match="positive multiple of 4096"):
        NVMeOptions(block_size=1000)
    with pytest.raises(NVMeOptionsError, match="between 1 and 1024"):
        NVMeOptions(queue_depth=0)
    with pytest.raises(NVMeOptionsError, match="choose one of auto, libaio, threads, buffered"):
        NVMeOptions(backend="spdk")
    monkeypatch.setenv("TIERWISE_NVME_QUEUE_DEPTH", "lots")
    with pytest.raises(NVMeOptionsError, match="give a whole number"):
        NVMeOptions.from_env()


def test_probe_hook_measures_once_per_path(nvme_dir, monkeypatch):
    import tierwise_nvme.probe as probe
    from tierwise.config import Config
    from tierwise.hardware import Hardware
    from tierwise.plugins import get_plugin_host

    calls = []
    real = probe.measure_bandwidth

    def counted(directory, nbytes=probe.PROBE_BYTES):
        calls.append(directory)
        return real(directory, 8 << 20)

    monkeypatch.setattr(probe, "measure_bandwidth", counted)
    config = Config(device="cpu", nvme_path=str(nvme_dir))
    hardware = Hardware(**get_plugin_host().probe_hardware(config=config))
    assert hardware.nvme_read_bandwidth > 0 and hardware.nvme_write_bandwidth > 0
    assert 0 < hardware.nvme_free
    get_plugin_host().probe_hardware(config=config)
    assert len(calls) == 1
    assert list(nvme_dir.iterdir()) == []  # the probe leaves no files behind
    assert get_plugin_host().probe_hardware(config=Config(device="cpu")).get("nvme_free") is None


def test_nvme_measurement_is_cached_per_path_on_disk_and_used_by_plans(nvme_dir, monkeypatch):
    import tierwise_nvme.probe as probe
    from tierwise.probe import cached_nvme
    from tierwise.target import target_hardware

    calls = []

    def fake_measure(directory, nbytes=probe.PROBE_BYTES):  # a disk of known speed
        calls.append(directory)
        return 2.5e9 + len(calls), 1.5e9

    monkeypatch.setattr(probe, "measure_bandwidth", fake_measure)
    first, second = nvme_dir / "a", nvme_dir / "b"
    assert probe.probe_nvme(first)["nvme_read_bandwidth"] == 2.5e9 + 1
    assert probe.probe_nvme(first)["nvme_read_bandwidth"] == 2.5e9 + 1  # cached: not measured
    assert probe.probe_nvme(second)["nvme_read_bandwidth"] == 2.5e9 + 2  # another path
    assert len(calls) == 2
    stored = cached_nvme(first)  # on disk, for the next process
    assert stored["nvme_write_bandwidth"] == 1.5e9 and stored["measured_at"]
    assert probe.probe_nvme(first, refresh=True)["nvme_read_bandwidth"] == 2.5e9 + 3
    # a plan for another machine with --nvme on this path uses the measurement and says so
    target = target_hardware(spec="a100-40gb,pcie4-nvme", device=None, gpus=1, nvme_path=str(first))
    assert target.hardware.nvme_read_bandwidth == 2.5e9 + 3  # measured beats the preset
    assert any(f"measured for {first}" in note for note in target.notes)
    unmeasured = target_hardware(
        spec="a100-40gb", device=None, gpus=1, nvme_path=str(nvme_dir / "c")
    )
    assert unmeasured.hardware.nvme_read_bandwidth is None
    assert any("not measured" in n and "tierwise probe --nvme-path" in n for n in unmeasured.notes)
    preset = target_hardware(
        spec="a100-40gb,pcie4-nvme", device=None, gpus=1, nvme_path=str(nvme_dir / "c")
    )
    assert preset.hardware.nvme_read_bandwidth == 6.0e9
    assert any("from --hardware" in n for n in preset.notes)
