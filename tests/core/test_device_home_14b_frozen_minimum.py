"""Core's planner sizes the 14-byte variant's rCache over the chunks that go through it: the
trainable device homes. Frozen device homes compute in place ([Note: the 14-byte device home]:
setup caches a group only when it is trainable, and checks the rCache minimum over the cached
chunks), so a frozen module using many chunks at once does not raise the variant's minimum."""

import pytest
from tierwise import Config, Hardware, ParamInfo, PlanError, Profile
from tierwise.planning.planner import default_plan

N = 1 << 14  # elements per parameter = per chunk (chunk_size N)
FROZEN = [f"emb.w{i}" for i in range(3)]  # one frozen module pinning 3 chunks at once
TRAINABLE = ["layers.0.w", "layers.1.w"]  # one chunk per module


def _profile() -> Profile:
    frozen = [
        ParamInfo(name=n, shape=(N,), numel=N, requires_grad=False, group="data/g0/frozen")
        for n in FROZEN
    ]
    trainable = [ParamInfo(name=n, shape=(N,), numel=N, group="data/g0/train") for n in TRAINABLE]
    order = FROZEN + TRAINABLE
    return Profile(
        params=frozen + trainable,
        forward_order=order,
        backward_order=order[::-1],
        module_params={"emb": FROZEN, **{n[:-2]: [n] for n in TRAINABLE}},
    )


def _plan(device_memory: int):
    config = Config(
        device="cpu",
        precision="bf16",
        chunk_size=N,
        prefetch=0,
        param_placement="device",
        optimizer_placement="device",
        device_memory=device_memory,
    )
    return default_plan(profile=_profile(), hardware=Hardware(device_type="cpu"), config=config)


def test_the_variants_rcache_minimum_counts_trainable_chunks_only():
    trainable, frozen = len(TRAINABLE) * N, len(FROZEN) * N
    # the variant: 14 bytes per trainable element, the frozen bf16 homes, and one rCache block
    # of a chunk (the trainable modules pin one chunk each; prefetch 0)
    variant = 14 * trainable + 2 * frozen + 1 * N * 2
    assert 16 * trainable + 2 * frozen > variant  # the 16-byte plan does not fit
    plan = _plan(variant)
    assert plan.grads_in_device_home and plan.param_tier == "device"
    assert plan.cache_blocks == 1 and plan.device_allowance == variant
    # one byte less: no room for the block the trainable chunks compute in; the refusal names
    # the variant's need
    with pytest.raises(PlanError) as info:
        _plan(variant - 1)
    assert (info.value.tier, info.value.need) == ("device", variant)
