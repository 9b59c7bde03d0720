"""The compute term: measured layer times win over FLOPs; the CPU step model adds its parts."""

from __future__ import annotations

import pytest

pytest.importorskip("tierwise_search")

from search_helpers import gpu_hardware, make_profile  # noqa: E402
from tierwise import Config, Hardware  # noqa: E402
from tierwise_search.compute import BACKWARD_OVER_FORWARD, layer_times  # noqa: E402
from tierwise_search.search import search_plan  # noqa: E402

K = 1024


def test_measured_layer_times_win_over_flops_and_fill_the_gaps():
    profile = make_profile([[512], [512], [512]], layer_bytes=1000, layer_flops=1e9)
    # layer_flops: blk0 1e9, blk1 2e9, blk2 3e9; blk1 measured, root measured but has no FLOPs
    profile.layer_forward_s = {"blk1": 0.5, "": 0.25}
    times = layer_times(profile, device_flops=1e10)
    assert times.layers == {"blk0": 0.1, "blk1": 0.5, "blk2": 0.3, "": 0.25}
    assert times.forward_s == pytest.approx(1.15)
    assert times.step_s == pytest.approx((1 + BACKWARD_OVER_FORWARD) * 1.15)
    assert "measured" in times.source


def test_without_measurements_flops_over_the_probed_rate():
    profile = make_profile([[512], [512]], layer_bytes=1000, layer_flops=1e9)
    times = layer_times(profile, device_flops=1e10)
    assert times.forward_s == pytest.approx(0.3)
    assert "FLOPs" in times.source


def cpu_hardware() -> Hardware:
    return Hardware(
        device_type="cpu",
        h2d_bandwidth=4e9,
        d2h_bandwidth=2e9,
        device_adam_velocity=1e8,
        host_adam_velocity=1e8,
        device_flops=1e12,
        nvme_read_bandwidth=1e9,
        nvme_write_bandwidth=5e8,
    )


def test_cpu_step_is_the_sum_of_compute_copies_and_the_nvme_optimizer():
    # Two modules of 2048 elements, one chunk each, both on host, 2 rCache blocks: each chunk is
    # fetched once (forward) and stays for backward; gradients (bf16) go to host once; the
    # optimizer states (12 B/element) are read from and written to NVMe; on CPU nothing overlaps.
    profile = make_profile([[2 * K], [2 * K]], checkpoint=False)
    profile.layer_forward_s = {"blk0": 0.01, "blk1": 0.02}
    config = Config(
        device="cpu",
        device_memory=10**6,
        chunk_size=2 * K,
        cache_blocks=2,
        param_placement="host",
        optimizer_placement="nvme",
        nvme_path="/tmp",
    )
    plan = search_plan(profile, cpu_hardware(), config)
    elements = 4 * K
    expected = {
        "compute": 3 * 0.03,
        "h2d": elements * 2 / 4e9,
        "d2h": elements * 2 / 2e9,
        "nvme_read": elements * 12 / 1e9,
        "nvme_write": elements * 12 / 5e8,
        "optimizer": elements / 1e8,
    }
    for name, value in expected.items():
        assert plan.predicted_step_s[name] == pytest.approx(value, rel=1e-12), name
    assert plan.predicted_step_s["total"] == pytest.approx(sum(expected.values()), rel=1e-12)


def test_gpu_step_overlaps_what_cpu_adds():
    profile = make_profile([[2 * K], [2 * K]], checkpoint=False)
    profile.layer_forward_s = {"blk0": 0.01, "blk1": 0.02}
    config = Config(
        device="cpu",
        device_memory=10**6,
        chunk_size=2 * K,
        param_placement="host",
        optimizer_placement="host",
    )
    gpu = search_plan(profile, gpu_hardware(), config).predicted_step_s
    # three blocks: one spare for prefetch, so fetches and gradient copies hide under compute
    assert gpu["total"] == pytest.approx(3 * 0.03 + gpu["optimizer"], rel=1e-12)
