"""The search's refusal quotes the activation choice that comes closest: swapping or recomputing
every block (from inputs kept on the device or swapped to the host) is a way to fit, so a device
too small for keeping every block's activations is refused with the smallest of those minimums,
not with all of them."""

import sys
from pathlib import Path

import pytest
from tierwise import Config, Hardware, PlanError
from tierwise_search.search import search_plan

sys.path.insert(0, str(Path(__file__).parent.parent / "core"))
from test_planner_activation_offload import BLOCK, HEAD, INPUT, LAYERS, _profile  # noqa: E402


def test_refusal_quotes_the_smallest_minimum_not_keeping_everything(tmp_path):
    keep = LAYERS * BLOCK + HEAD
    # hand-computed ([Note: activation peak under a policy]), the profile has no backward peaks
    # so a block's backward is bounded by its own bytes plus the head's:
    swapped = HEAD + 3 * BLOCK  # the last block's backward and two blocks read back ahead
    # every block recomputed: the last one's backward, with the inputs of all blocks held
    recomputed = LAYERS * INPUT + BLOCK + HEAD
    # every block recomputed from inputs swapped to the host: the third block's backward, its
    # inputs read back and two blocks' read ahead
    from_host = HEAD + BLOCK + 3 * INPUT  # the smallest: from_host < recomputed < swapped
    config = Config(
        device="cuda", precision="bf16", activation_offload="auto", nvme_path=str(tmp_path)
    )

    def plan_on(device):
        return search_plan(_profile(), Hardware(device_type="cuda", device_memory=device), config)

    # room to recompute from inputs on the device is room to recompute from host inputs
    plan = plan_on(int(1.25 * recomputed))
    assert set(plan.activation_policy.values()) == {"recompute_host"}
    with pytest.raises(PlanError, match="device memory binds") as info:
        plan_on(int(1.25 * from_host))  # too small for every choice
    need = info.value.need
    assert 1.25 * from_host < need < 1.25 * keep  # the closest choice's device, not keep's
    assert need < 1.25 * min(recomputed, swapped)  # nor the other choices'
    assert need - 1.25 * from_host < 2**20 * 10  # + model data in the rCache and buffers
    assert "recompute from host: peak at the backward of layers.2" in str(info.value)


def test_swapping_is_the_smallest_when_inputs_are_large(tmp_path):
    # blocks handed 80 MiB each: recomputing all holds 8 x 80 MiB, recomputing from inputs
    # swapped to the host three blocks' inputs at once (150 + 3 x 80 MiB), swapping all
    # 50 + 3 x 100 MiB
    profile = _profile()
    profile.module_input_bytes = dict.fromkeys(profile.module_input_bytes, 80 * 2**20)
    swapped = HEAD + 3 * BLOCK
    device = int(1.25 * swapped)
    with pytest.raises(PlanError, match="device memory binds") as info:
        search_plan(
            profile,
            Hardware(device_type="cuda", device_memory=device),
            Config(device="cuda", precision="bf16", activation_offload="auto"),
        )
    assert 1.25 * swapped < info.value.need < 1.25 * swapped + 2**20 * 10
    # the first block with two swapped blocks before it to read back ahead
    assert "swap to host: peak at the backward of layers.2" in str(info.value)


def test_recomputing_from_host_inputs_fits_where_swapping_does_not_at_60_mib_inputs():
    # blocks handed 60 MiB each: from host inputs 150 + 3 x 60 = 330 MiB < swapping's 350 MiB
    profile = _profile()
    profile.module_input_bytes = dict.fromkeys(profile.module_input_bytes, 60 * 2**20)
    swapped = HEAD + 3 * BLOCK
    plan = search_plan(
        profile,
        Hardware(device_type="cuda", device_memory=int(1.25 * swapped)),
        Config(device="cuda", precision="bf16", activation_offload="auto"),
    )
    assert set(plan.activation_policy.values()) == {"recompute_host"}
    assert plan.activation_allowance == int(1.25 * (HEAD + BLOCK + 3 * 60 * 2**20))
