"""The search's refusal quotes the activation choice that comes closest: swapping every block is
a way to fit, so a device too small for keeping every block's activations is refused with the
swapped minimum (the activations outside blocks and one block's), not with all of them."""

import sys
from pathlib import Path

import pytest
from tierwise import Config, Hardware, PlanError
from tierwise_search.search import search_plan

sys.path.insert(0, str(Path(__file__).parent.parent / "core"))
from test_planner_activation_offload import BLOCK, HEAD, LAYERS, _profile  # noqa: E402


def test_refusal_quotes_the_swapped_minimum_not_keeping_everything(tmp_path):
    keep = LAYERS * BLOCK + HEAD
    swapped = HEAD + BLOCK
    device = int(1.25 * swapped)  # too small even with every block swapped
    with pytest.raises(PlanError, match="device memory binds") as info:
        search_plan(
            _profile(),
            Hardware(device_type="cuda", device_memory=device),
            Config(
                device="cuda",
                precision="bf16",
                activation_offload="auto",
                nvme_path=str(tmp_path),
            ),
        )
    need = info.value.need
    assert 1.25 * swapped < need < 1.25 * keep  # the swapped choice's device, not keep's
    assert need - 1.25 * swapped < 2**20 * 10  # + model data in the rCache and buffers
