"""LoHan-style activation policy: swap the layers with most FLOPs per byte, recompute the rest,
at the split that minimises the predicted step."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("tierwise_search")

from search_helpers import gpu_hardware, make_profile  # noqa: E402
from tierwise import Config  # noqa: E402
from tierwise_search.search import search_plan  # noqa: E402


def profile_with_layers():
    profile = make_profile(
        [[4096, 4096] for _ in range(6)], layer_bytes=50_000_000, layer_flops=4e11
    )
    return profile


def config(**kwargs):
    return Config(device="cpu", device_memory=10**8, **kwargs)


def flops_per_byte(profile, layer):
    return profile.layer_flops[layer] / profile.layer_activation_bytes[layer]


def test_swapped_layers_have_more_flops_per_byte_than_recomputed_ones():
    profile = profile_with_layers()
    # 6 layers of 50 MB and 4e11..12e11 FLOPs, compute 144 ms: at 1 GB/s swapping all costs
    # 300 ms of link time, so the best split swaps the three with most FLOPs per byte
    plan = search_plan(
        profile,
        gpu_hardware(h2d_bandwidth=1e9, d2h_bandwidth=1e9),
        config(activation_offload="host"),
    )
    swapped = [layer for layer, action in plan.activation_policy.items() if action == "host"]
    recomputed = [
        layer for layer, action in plan.activation_policy.items() if action == "recompute"
    ]
    assert len(swapped) == 3 and len(recomputed) == 3
    assert min(flops_per_byte(profile, x) for x in swapped) >= max(
        flops_per_byte(profile, x) for x in recomputed
    )


def test_split_follows_the_link_speed():
    profile = profile_with_layers()
    fast = search_plan(
        profile,
        gpu_hardware(h2d_bandwidth=1e13, d2h_bandwidth=1e13),
        config(activation_offload="host"),
    )
    assert set(fast.activation_policy.values()) == {"host"}
    slow = search_plan(
        profile,
        gpu_hardware(h2d_bandwidth=1e6, d2h_bandwidth=1e6),
        config(activation_offload="host"),
    )
    assert set(slow.activation_policy.values()) == {"recompute"}
    assert slow.predicted_step_s["compute"] > fast.predicted_step_s["compute"]


def test_swap_to_nvme_moves_bytes_through_the_disk():
    profile = profile_with_layers()
    plan = search_plan(
        profile,
        gpu_hardware(
            h2d_bandwidth=1e13,
            d2h_bandwidth=1e13,
            nvme_read_bandwidth=1e13,
            nvme_write_bandwidth=1e13,
        ),
        config(activation_offload="nvme", nvme_path="/tmp"),
    )
    assert set(plan.activation_policy.values()) == {"nvme"}
    assert plan.predicted_step_s["nvme_write"] >= 6 * 50_000_000 / 1e13


def test_checkpointing_without_offload_recomputes_blocks_only():
    plan = search_plan(profile_with_layers(), gpu_hardware(), config(activation_checkpointing=True))
    assert set(plan.activation_policy.values()) == {"recompute"}
    plan = search_plan(profile_with_layers(), gpu_hardware(), config())
    assert set(plan.activation_policy.values()) == {"keep"}


def test_auto_frees_device_memory_for_model_data_when_activations_crowd_it():
    profile = profile_with_layers()  # 300 MB of activations
    capacity = int(profile.peak_activation_bytes * 1.25) + 300_000  # model data needs 786 KB
    hardware = gpu_hardware(device_memory=capacity)
    # host Adam after backward: device residency saves it (in backward it hides on CUDA, and
    # the two plans tie within a chunk's device Adam)
    after = "after-backward"
    keep = search_plan(profile, hardware, Config(device="cpu", optimizer_overlap=after))
    auto = search_plan(
        profile,
        hardware,
        Config(device="cpu", activation_offload="auto", optimizer_overlap=after),
    )
    assert auto.predicted_step_s["total"] <= keep.predicted_step_s["total"]
    assert auto.device_allowance > keep.device_allowance
    assert any(alt["summary"].startswith("activations:") for alt in auto.alternatives)


def test_plan_table_and_reasons_give_every_blocks_choice():
    profile = profile_with_layers()
    plan = search_plan(
        profile,
        gpu_hardware(h2d_bandwidth=1e9, d2h_bandwidth=1e9),
        config(activation_offload="host"),
    )
    table = plan.table()
    # the table collapses a run of consecutive blocks with one choice into one row ("blk0–3
    # keep", tierwise.plan.collapse_runs): expand the runs, every block's choice must be there
    rows = {}
    for row in table.splitlines():
        if not row.startswith("  ") or row.startswith(("  why:", "  rejected:")):
            continue
        name, choice = row.strip().split(None, 1)
        run = re.fullmatch(r"(.*?)(\d+)–(\d+)(.*)", name)
        if run is None:
            rows[name] = choice
            continue
        head, first, last, tail = run.groups()
        for number in range(int(first), int(last) + 1):
            rows[f"{head}{number}{tail}"] = choice
    assert rows == plan.activation_policy
    for block, action in plan.activation_policy.items():
        line = next(r for r in plan.reasons if r.startswith(f"activations of {block}: "))
        assert line.startswith(f"activations of {block}: {action} (")
        assert "benefit rank" in line


def test_model_data_traffic_on_the_link_leaves_less_room_for_swaps():
    # the same six 50 MB blocks and 1 GB/s link as above, with 25 M-element blocks of parameters:
    # kept on the device, three blocks swap; on the host, chunk fetches and gradient offload keep
    # both directions of the link busier than compute, so every swapped byte would lengthen the
    # step and the search recomputes every block instead
    profile = make_profile(
        [[12_500_000, 12_500_000] for _ in range(6)], layer_bytes=50_000_000, layer_flops=4e11
    )
    hardware = gpu_hardware(h2d_bandwidth=1e9, d2h_bandwidth=1e9, device_memory=10**11)

    def swapped(placement):
        plan = search_plan(
            profile,
            hardware,
            Config(
                device="cpu",
                activation_offload="host",
                param_placement=placement,
                optimizer_placement=placement,
            ),
        )
        return [block for block, action in plan.activation_policy.items() if action == "host"], plan

    on_device, device_plan = swapped("device")
    on_host, host_plan = swapped("host")
    assert len(on_device) == 3 and on_host == []
    assert device_plan.predicted_step_s["h2d"] == pytest.approx(3 * 50_000_000 / 1e9)  # swaps only
    assert host_plan.predicted_step_s["h2d"] > host_plan.predicted_step_s["compute"]
