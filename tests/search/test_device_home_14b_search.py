"""The search and the 14-byte device home (core's [Note: the 14-byte device home]): one rank in
bf16 whose 16-byte plan misses the device by less than 2 bytes per element is planned with the
gradients in the device homes, counted as core counts them, and refused one size up."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tierwise_search")

from search_helpers import gpu_hardware, make_profile  # noqa: E402
from tierwise import Config  # noqa: E402
from tierwise.chunks.payload import model_data_by_tier  # noqa: E402
from tierwise.plan import PlanError  # noqa: E402

CHUNK = 8192
HOST = 1 << 16  # no host room for model data: the device must hold it


def _profile(blocks: int = 8):
    return make_profile([[700, 2300, 4096, 4096, 300] for _ in range(blocks)], head=6000)


def _plan(profile, **config):
    from tierwise_search.search import search_plan

    config = Config(device="cpu", precision=config.pop("precision", "bf16"), **config)
    return search_plan(profile, gpu_hardware(world_size=1), config)


def _elements(profile) -> int:
    from tierwise_search.layout import build_chunks

    return int(build_chunks(profile, CHUNK).capacity.sum())


def test_the_cost_model_counts_14_bytes_and_the_blocks():
    from tierwise_search.activations import activation_choices
    from tierwise_search.cost import DEVICE, Placement
    from tierwise_search.search import _Search

    profile = _profile()
    search = _Search(profile, gpu_hardware(world_size=1), Config(precision="bf16"), "engine")
    search.grads_in_device_home = True
    choice = activation_choices(
        profile, search.times.layers, offload="off", checkpointing=False, nvme=False
    )[0]
    model = search.model(CHUNK, choice)
    s = model.setting
    n = s.table.n_chunks
    placement = Placement(n_blocks=3, param_tier=np.full(n, DEVICE), optim_tier=np.full(n, DEVICE))
    assert s.uses_rcache(placement.param_tier).all()  # every trainable chunk computes in a block
    core = model_data_by_tier(
        [(int(c), True, False) for c in s.shard_sizes],
        precision="bf16",
        param_tier="device",
        optim_tier="device",
        grads_in_device_home=True,
    )
    assert core == {"device": 14 * int(s.shard_sizes.sum())}  # by hand: 2 + 4 + 8
    block = s.block_numel * 2
    assert model.memory(placement).device == core["device"] + 3 * block
    # the copies into blocks and into the homes are priced, on the device's memory bandwidth
    assert model.predict(placement).seconds["device_copies"] > 0


def test_a_model_missing_the_device_by_less_than_2_bytes_per_element_is_planned_at_14():
    profile = _profile()
    elements = _elements(profile)
    full = _plan(profile, chunk_size=CHUNK, device_memory=16 * elements, host_memory=HOST)
    assert not full.grads_in_device_home and full.device_allowance == 16 * elements  # by hand
    budget = 16 * elements - 1
    plan = _plan(profile, chunk_size=CHUNK, device_memory=budget, host_memory=HOST)
    assert plan.grads_in_device_home
    assert set(plan.param_tiers["data/g0/train"]) == {"device"}
    assert set(plan.optim_tiers["data/g0/train"]) == {"device"}
    assert plan.device_allowance == 14 * elements + plan.cache_blocks * CHUNK * 2 <= budget
    # one size up (more blocks): 14 bytes per element no longer fit that budget
    bigger = _profile(blocks=10)
    assert 14 * _elements(bigger) > budget
    with pytest.raises(PlanError, match="memory binds"):
        _plan(bigger, chunk_size=CHUNK, device_memory=budget, host_memory=HOST)


def test_fp32_is_refused_rather_than_planned_at_14():
    profile = _profile()
    elements = _elements(profile)
    with pytest.raises(PlanError):  # fp32 has no 2-byte payload to reuse: refused, not 14
        _plan(
            profile,
            precision="fp32",
            chunk_size=CHUNK,
            device_memory=16 * elements - 1,
            host_memory=HOST,
        )
