"""[Note: chunk padding]: a group's last chunk is as large as what it holds, and core's "auto"
chunk size wastes at most ``PADDING_LIMIT`` of the parameters when a size does, taking the first
such size whose plan fits the budgets. Padding counted by hand."""

from __future__ import annotations

import random

import pytest
import tierwise
import torch
from helpers.models import tiny_batch, tiny_model
from tierwise import Config, Hardware, ParamInfo, PlanError, Profile
from tierwise.chunks.layout import filling_sizes, pack, padding, padding_at
from tierwise.planning.chunk_size import PADDING_LIMIT, aim, auto_chunk_sizes
from tierwise.planning.planner import default_plan

# four parameters a, b, c, d of 1536, 512, 1536, 512 elements, in packing order
SIZES = [1536, 512, 1536, 512]
NUMELS = dict(zip("abcd", SIZES, strict=True))


@pytest.mark.parametrize(
    ("chunk_size", "capacities", "wasted"),
    [
        (2048, [2048, 2048], 0),  # [a b] [c d]
        (2560, [2560, 2048], 512),  # [a b] pads 512; [c d] is the last chunk: no padding
        (3584, [3584, 512], 0),  # [a b c] [d]
        (1536, [1536, 1536, 1536, 512], 1024),  # [a] [b] pads 1024 [c] [d]
        (1000, [1536, 1000, 1536, 512], 488),  # a, c oversize: chunks of their own; [b] pads
        (1024, [1536, 1024, 1536, 512], 512),  # [a] [b] pads 512 [c] [d]
        (9999, [4096], 0),  # one chunk, as large as the four
    ],
)
def test_packing_pads_by_hand_and_the_last_chunk_holds_what_it_packs(
    chunk_size, capacities, wasted
):
    chunks = pack(list(NUMELS), NUMELS, chunk_size)
    assert [c.capacity for c in chunks] == capacities
    assert padding(chunks) == wasted == padding_at(SIZES, chunk_size)


def test_padding_at_counts_what_packing_allocates():
    rng = random.Random(0)
    for _ in range(500):
        sizes = [rng.choice([1, 7, 64, 100, 1000, 3000]) for _ in range(rng.randint(1, 30))]
        chunk_size = rng.randint(50, 6000)
        names = [f"p{i}" for i in range(len(sizes))]
        chunks = pack(names, dict(zip(names, sizes, strict=True)), chunk_size)
        assert padding_at(sizes, chunk_size) == padding(chunks), (sizes, chunk_size)


def test_filling_sizes_are_the_runs_of_consecutive_parameters():
    # runs: a 1536, a b 2048, a b c 3584, a b c d 4096, b c 2048, b c d 2560, c 1536, c d 2048
    # (b and d alone, 512, are below 1024)
    assert filling_sizes([SIZES], 1024, 4096, 64) == [1536, 2048, 2560, 3584, 4096]
    # rounded up to 1024: b and d make 1024, b c d 3072
    assert filling_sizes([SIZES], 1024, 4096, 1024) == [1024, 2048, 3072, 4096]
    assert filling_sizes([SIZES, [3000]], 2900, 3100, 64) == [3008]


def _gpt2_sizes(model: torch.nn.Module) -> list[int]:
    return [p.numel() for p in model.parameters()]


def test_auto_sizes_waste_at_most_the_limit_nearest_the_aim_first():
    model = tiny_model("gpt2")
    sizes = _gpt2_sizes(model)
    total, goal = sum(sizes), aim(sum(sizes), max(sizes))
    tried = auto_chunk_sizes([sizes])
    assert tried[-1] == goal or goal in tried  # the aim is always tried, last if not lean
    lean = [s for s in tried if padding_at(sizes, s) <= PADDING_LIMIT * total]
    assert lean and tried[: len(lean)] == lean  # the lean sizes come first
    assert all(s % 64 == 0 and s >= max(sizes) for s in tried)
    distance = [abs(torch.tensor(s / goal).log().item()) for s in lean]
    assert distance == sorted(distance)


def test_the_plan_takes_the_aim_when_no_lean_size_fits_the_device():
    # 16 parameters of 5000 and 3000 elements, alternating: the aim is 5000 (the largest),
    # which pads 2000 after every 3000 (25 %); 8000 packs pairs with no padding and is the lean
    # size nearest the aim. A device budget of one bf16 rCache block of 6000 elements holds a
    # chunk of 5000, not one of 8000 (nor any larger lean size): the plan falls back to the aim.
    numels = [5000, 3000] * 8
    names = [f"layers.{i}.w" for i in range(16)]
    profile = Profile(
        params=[ParamInfo(name=n, shape=(x,), numel=x) for n, x in zip(names, numels, strict=True)],
        forward_order=names,
        backward_order=names[::-1],
        module_params={n[:-2]: [n] for n in names},
    )
    hardware = Hardware(device_type="cpu")
    tried = auto_chunk_sizes([numels])
    assert tried[0] == 8000 and tried[-1] == aim(64000, 5000) == 5000
    assert padding_at(numels, 8000) == 0 and padding_at(numels, 5000) == 7 * 2000
    forced = dict(param_placement="host", optimizer_placement="host", cache_blocks=1)
    roomy = default_plan(profile=profile, hardware=hardware, config=Config(device="cpu", **forced))
    assert roomy.chunk_size == 8000
    budget = 2 * 6000
    with pytest.raises(PlanError):
        default_plan(
            profile=profile,
            hardware=hardware,
            config=Config(device="cpu", device_memory=budget, chunk_size=8000, **forced),
        )
    tight = default_plan(
        profile=profile,
        hardware=hardware,
        config=Config(device="cpu", device_memory=budget, **forced),
    )
    assert tight.chunk_size == 5000
    assert tight.device_allowance <= budget


def test_setup_packs_the_last_chunk_of_each_group_to_what_it_holds():
    model = tiny_model("gpt2")
    model.transformer.wpe.weight.requires_grad_(False)  # a second (frozen) group
    n_params = sum(p.numel() for p in model.parameters())
    model, opt = tierwise.setup(
        model,
        torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]),
        device="cpu",
        param_placement="host",
        cache_blocks=2,
    )
    engine = tierwise.engine_of(model)
    try:
        model(**tiny_batch()).loss.backward()
        opt.step()
        for group in engine.groups:
            last = group.chunks[-1]
            assert last.capacity == sum(s.numel for s in last.slots)
        allocated = sum(c.capacity for c in engine.chunks())
        assert allocated - n_params <= PADDING_LIMIT * n_params
    finally:
        engine.close()
