"""Hardware probe: plausible numbers, one measurement per machine, --refresh."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tierwise_profiler")

from tierwise.config import Config  # noqa: E402
from tierwise.hardware import Hardware  # noqa: E402
from tierwise.plugins import get_plugin_host  # noqa: E402
from tierwise.probe import cache_dir  # noqa: E402
from tierwise_profiler import hardware_probe  # noqa: E402


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A private cache dir holding one real measurement (about a second)."""
    path = tmp_path_factory.mktemp("tierwise_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIERWISE_CACHE_DIR", str(path))
        entry = hardware_probe.probe("cpu", "fp32")
        yield path, entry


def test_numbers_are_positive_and_plausible(cache):
    _, entry = cache
    hw = entry["hardware"]
    assert hw["device_type"] == "cpu"
    assert 1e7 < hw["h2d_bandwidth"] < 1e12 and hw["d2h_bandwidth"] == hw["h2d_bandwidth"]
    assert 1e5 < hw["host_adam_velocity"] < 1e12
    assert hw["device_adam_velocity"] == hw["host_adam_velocity"]  # the CPU is the device
    assert 1e7 < hw["device_flops"] < 1e15
    curve = entry["curves"]["host_memcpy"]
    assert [int(size) for size in curve] == list(hardware_probe.COPY_SIZES)
    assert all(1e7 < bandwidth < 1e12 for bandwidth in curve.values())
    assert entry["seconds"] < 30  # the probe is meant to take ~1-3 s; this only catches hangs


def test_second_probe_reads_the_cache_without_measuring(cache, monkeypatch):
    path, entry = cache
    monkeypatch.setenv("TIERWISE_CACHE_DIR", str(path))

    def must_not_measure(*args, **kwargs):
        raise AssertionError("measured again although the cache has this machine")

    monkeypatch.setattr(hardware_probe, "measure", must_not_measure)
    assert hardware_probe.probe("cpu", "fp32") == entry
    stored = json.loads((path / hardware_probe.CACHE_FILE).read_text())
    assert stored[entry["key"]] == entry
    # the hook gives Hardware fields only, from the cache, merged with core's memory facts
    hardware = Hardware(
        **get_plugin_host().probe_hardware(config=Config(device="cpu", precision="fp32"))
    )
    assert hardware.device_flops == entry["hardware"]["device_flops"]
    assert hardware.host_memory and hardware.host_memory > 0


def test_refresh_measures_again_and_replaces_the_entry(cache, monkeypatch):
    path, entry = cache
    monkeypatch.setenv("TIERWISE_CACHE_DIR", str(path))
    fresh = {**entry, "measured_at": "now", "hardware": {**entry["hardware"], "device_flops": 1.0}}
    monkeypatch.setattr(hardware_probe, "measure", lambda device, precision: dict(fresh))
    assert hardware_probe.probe("cpu", "fp32", refresh=True)["measured_at"] == "now"
    stored = json.loads((path / hardware_probe.CACHE_FILE).read_text())
    assert stored[entry["key"]]["hardware"]["device_flops"] == 1.0
    other_precision = hardware_probe.probe("cpu", "bf16")  # another key: measured, kept apart
    assert other_precision["key"] != entry["key"]
    assert len(json.loads((path / hardware_probe.CACHE_FILE).read_text())) == 2


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("TIERWISE_CACHE_DIR", str(tmp_path / "explicit"))
    assert cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("TIERWISE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "tierwise"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "tierwise"
