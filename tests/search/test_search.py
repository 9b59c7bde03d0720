"""The plan search: hand-computable optima, monotonicity in device memory, errors, forced settings."""

from __future__ import annotations

import pytest

pytest.importorskip("tierwise_search")

from search_helpers import gpu_hardware, make_profile  # noqa: E402
from tierwise import Config, Plan, PlanError  # noqa: E402
from tierwise.plugins import get_plugin_host  # noqa: E402
from tierwise_search.search import search_plan  # noqa: E402

K = 1024


def hand_profile():
    """Four parameters a, b, c, d of 1536, 512, 1536, 512 elements, each its own module, used
    a, b, c, d forward and d, c, b, a backward; no FLOPs, so compute time is zero."""
    profile = make_profile([[1536, 512], [1536, 512]], checkpoint=False)
    profile.batch_size = profile.seq_len = None
    return profile


def test_hand_case_chunk_size_and_rcache():
    # Candidates: every multiple of 64 from 1536 to 4096 elements. Device budget: two blocks of
    # 2048 bf16 elements (8 KiB) and a bit. 2048 packs [a,b] [c,d] with no padding and two
    # blocks hold both, so each chunk is fetched once: 4096 elements moved. 4096 is one chunk
    # fetched once: also 4096 moved and no padding, so the smaller size wins. Sizes in between
    # pad, and above 2073 only one block fits, so [a,b] is fetched twice. Nothing else fits: a
    # chunk on the device needs 2048 x (2 + 12 + 2) bytes.
    hardware = gpu_hardware()
    plan = search_plan(hand_profile(), hardware, Config(device="cpu", device_memory=8 * K + 100))
    assert plan.chunk_size == 2 * K
    assert plan.cache_blocks == 2
    assert plan.param_tiers == {"data/g0/train": ["host", "host"]}
    assert plan.optim_tiers == {"data/g0/train": ["host", "host"]}
    assert plan.device_allowance == 2 * 2 * K * 2
    moved = 4 * K * 2  # bytes in (each chunk once) and gradients out (each chunk once)
    phase = max(moved / hardware.h2d_bandwidth, moved / hardware.d2h_bandwidth)
    # host Adam on the worker in backward ([Note: speculation pricing]): [c,d]'s gradients are
    # final halfway through backward (the whole phase: no compute), then both chunks' Adam
    expected = phase / 2 + 4 * K / hardware.host_adam_velocity
    assert plan.predicted_step_s["total"] == pytest.approx(expected, rel=1e-12)
    assert plan.predicted_step_s["compute"] == 0
    after = search_plan(
        hand_profile(),
        hardware,
        Config(device="cpu", device_memory=8 * K + 100, optimizer_overlap="after-backward"),
    )
    after_expected = phase + 4 * K / hardware.host_adam_velocity  # Adam once backward ends
    assert after.predicted_step_s["total"] == pytest.approx(after_expected, rel=1e-12)


def test_hand_case_everything_fits_on_the_device():
    hardware = gpu_hardware()
    plan = search_plan(hand_profile(), hardware, Config(device="cpu", device_memory=10 * 2**20))
    assert set(plan.param_tiers["data/g0/train"]) == {"device"}
    assert set(plan.optim_tiers["data/g0/train"]) == {"device"}
    assert plan.cache_blocks == 0
    assert plan.predicted_step_s["total"] == pytest.approx(4 * K / hardware.device_adam_velocity)
    assert plan.device_allowance == 4 * K * (2 + 12 + 2)


def stack_profile(**kwargs):
    blocks = [[700, 2300, 4096, 4096, 300] for _ in range(8)]
    return make_profile(blocks, head=6000, layer_bytes=200_000, layer_flops=3e8, **kwargs)


@pytest.mark.parametrize(
    "hardware_kwargs, config_kwargs",
    [
        ({}, {}),
        ({"device_type": "cpu"}, {}),
        ({}, {"activation_checkpointing": True}),
        ({"host_adam_velocity": 1e11}, {"prefetch": 0}),  # host optimizer faster than device
        ({"world_size": 2}, {}),
        ({}, {"host_memory": 600_000, "nvme_path": "/tmp"}),
    ],
)
def test_more_device_memory_never_predicts_a_slower_step(hardware_kwargs, config_kwargs):
    profile, hardware = stack_profile(), gpu_hardware(**hardware_kwargs)
    totals, budgets = [], [int(30_000 * 1.25**i) for i in range(19)]  # 30 KB .. 1.7 MB
    for budget in budgets:
        config = Config(device="cpu", device_memory=budget, **config_kwargs)
        try:
            plan = search_plan(profile, hardware, config)
        except PlanError:
            assert not totals, f"{budget} bytes failed after a smaller budget worked"
            continue
        assert plan.device_allowance <= budget
        totals.append(plan.predicted_step_s["total"])
    assert len(totals) >= 8
    for smaller, larger in zip(totals, totals[1:], strict=False):
        assert larger <= smaller * (1 + 1e-9)
    assert totals[-1] < totals[0]


def test_too_small_budget_states_the_minimum_and_the_minimum_works():
    profile, hardware = stack_profile(), gpu_hardware()
    with pytest.raises(PlanError, match="device memory binds.*short") as info:
        search_plan(profile, hardware, Config(device="cpu", device_memory=1000))
    assert (info.value.tier, info.value.limit) == ("device", 1000)
    minimum = info.value.need
    plan = search_plan(profile, hardware, Config(device="cpu", device_memory=minimum))
    assert plan.device_allowance <= minimum
    with pytest.raises(PlanError):
        search_plan(profile, hardware, Config(device="cpu", device_memory=minimum - 1))


def test_too_small_device_capacity_states_the_minimum_capacity():
    profile = stack_profile()
    with pytest.raises(PlanError, match="device memory binds: .* needs a device of") as info:
        search_plan(profile, gpu_hardware(device_memory=2_000_000), Config(device="cpu"))
    assert (info.value.tier, info.value.limit) == ("device", 2_000_000)
    capacity = info.value.need
    plan = search_plan(profile, gpu_hardware(device_memory=capacity), Config(device="cpu"))
    assert plan.device_allowance <= 0.95 * capacity


def test_forced_settings_are_taken_exactly():
    profile, hardware = stack_profile(), gpu_hardware()
    config = Config(
        device="cpu",
        device_memory=10**8,
        chunk_size=9000,
        cache_blocks=5,
        param_placement="host",
        optimizer_placement="nvme",
        nvme_path="/tmp",
    )
    plan = search_plan(profile, hardware, config)
    assert (plan.chunk_size, plan.cache_blocks) == (9000, 5)
    assert {t for tiers in plan.param_tiers.values() for t in tiers} == {"host"}
    assert {t for tiers in plan.optim_tiers.values() for t in tiers} == {"nvme"}
    plan = search_plan(
        profile,
        hardware,
        Config(
            device="cpu", device_memory=10**8, param_placement="device", optimizer_placement="host"
        ),
    )
    assert {t for tiers in plan.param_tiers.values() for t in tiers} == {"device"}
    assert {t for tiers in plan.optim_tiers.values() for t in tiers} == {"host"}
    assert plan.cache_blocks == 0


def test_forced_placement_that_does_not_fit_says_so():
    with pytest.raises(PlanError, match="param_placement='device'.*raise device_memory"):
        search_plan(
            stack_profile(),
            gpu_hardware(),
            Config(device="cpu", device_memory=100_000, param_placement="device"),
        )


def test_too_few_forced_cache_blocks_is_an_error():
    # a block's re-forward holds its last module and one other module at a time
    # ([Note: the rCache minimum]), not the whole block
    with pytest.raises(
        PlanError, match="cache_blocks=1 is below this model.s minimum of 2 rCache blocks"
    ):
        search_plan(
            stack_profile(),
            gpu_hardware(),
            Config(
                device="cpu",
                device_memory=10**7,
                chunk_size=8192,
                cache_blocks=1,
                param_placement="host",
                activation_checkpointing=True,
            ),
        )


def test_small_host_budget_puts_optimizer_states_on_nvme():
    profile = stack_profile()
    total = profile.total_numel
    config = Config(device="cpu", device_memory=100_000, host_memory=total * 8, nvme_path="/tmp")
    plan = search_plan(profile, gpu_hardware(), config)
    optim = [t for tiers in plan.optim_tiers.values() for t in tiers]
    assert "nvme" in optim
    assert plan.predicted_step_s["nvme_read"] > 0
    with pytest.raises(
        PlanError, match="host memory binds.*short; raise host_memory or set nvme_path"
    ):
        search_plan(
            profile,
            gpu_hardware(),
            Config(device="cpu", device_memory=100_000, host_memory=total * 8),
        )


def test_plugin_answers_make_plan_before_core_and_plan_round_trips():
    profile, hardware = stack_profile(), gpu_hardware()
    plan = get_plugin_host().make_plan(
        profile=profile, hardware=hardware, config=Config(device="cpu", device_memory=300_000)
    )
    assert plan.planner == "search"
    assert plan.reasons and plan.alternatives
    assert Plan.from_json(plan.to_json()) == plan
