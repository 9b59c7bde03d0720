"""The core planner's device-binds error quotes numbers the user's forced settings allow."""

import pytest
from tierwise import Config, Hardware, ParamInfo, PlanError, Profile
from tierwise.planning.planner import default_plan


def _stack_profile(blocks: int, numel: int) -> Profile:
    names = [f"layers.{b}.w" for b in range(blocks)]
    return Profile(
        params=[ParamInfo(name=n, shape=(numel,), numel=numel) for n in names],
        forward_order=names,
        backward_order=names[::-1],
        module_params={n[:-2]: [n] for n in names},
    )


def _plan(profile, budget, **config):
    return default_plan(
        profile=profile,
        hardware=Hardware(device_type="cpu"),
        config=Config(device="cpu", device_memory=budget, chunk_size=1 << 20, **config),
    )


def test_forced_cache_blocks_names_itself_and_how_many_fit():
    profile = _stack_profile(16, 1 << 20)
    roomy = _plan(profile, 1 << 40)
    with pytest.raises(PlanError) as too_small:  # what the smallest plan needs
        _plan(profile, 1)
    smallest = _plan(profile, too_small.value.need)
    assert smallest.param_tier == smallest.optim_tier == "host"
    block = (1 << 20) * 2  # one bf16 block of a chunk
    budget = smallest.device_allowance + 3 * block  # room for three more blocks, not 16
    with pytest.raises(PlanError) as info:
        _plan(profile, budget, cache_blocks=16)
    message = str(info.value)
    assert "\n" not in message
    assert "cache_blocks=16 is what binds" in message
    assert info.value.tier == "device" and info.value.need > info.value.limit == budget
    # the forced plan keeps everything off the device but the blocks, like the smallest plan
    assert "params on host, optimizer on host, 16 rCache blocks" in message
    most = smallest.cache_blocks + 3
    assert f"at most {most} rCache blocks fit" in message
    # the advice holds: that many blocks plan, one more does not
    assert _plan(profile, budget, cache_blocks=most).cache_blocks == most
    with pytest.raises(PlanError):
        _plan(profile, budget, cache_blocks=most + 1)
    assert roomy.param_tier == "device"


def test_budget_below_the_smallest_plan_quotes_a_need_above_the_budget():
    profile = _stack_profile(16, 1 << 20)
    with pytest.raises(PlanError) as info:
        _plan(profile, 1 << 20, cache_blocks=8)
    message = str(info.value)
    assert "lower cache_blocks to" in message and "raise device_memory" in message
    assert info.value.need > info.value.limit == 1 << 20
