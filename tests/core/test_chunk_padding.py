"""[Note: chunk padding] (tierwise.planning.chunk_size): the chunk size is chosen to waste at most
3% of the parameters, and chunks are never trimmed, so the planner's bytes are the runtime's.

- ``padding_by_size`` equals core's packing (``pack``) for every size at once;
- a GPT-2 medium shape (302M parameters, one chunk group): core's "auto" size wastes at most 3%
  where its old aim wasted 4.4%, and the plan's bytes per tier are the hand count for each
  placement (14 bytes per chunk element in bf16 with fp32 Adam).
The engine's peak equals the plan's bytes in tests/core/test_grads_in_home.py (core's planner)
and tests/search/test_bytes_per_param.py (the search's, at most 14.5 B/param).
"""

from __future__ import annotations

import random

import pytest
from tierwise.chunks.layout import pack, padding, padding_by_size
from tierwise.config import Config
from tierwise.hardware import Hardware
from tierwise.planning.chunk_size import PADDING_LIMIT, auto_aim, auto_chunk_sizes
from tierwise.planning.planner import default_plan
from tierwise.planning.totals import plan_model_bytes
from tierwise.profile import ParamInfo, Profile


def test_padding_by_size_is_the_packing_s_padding():
    rng = random.Random(0)
    for _ in range(100):
        groups = [[rng.randint(1, 5000) for _ in range(rng.randint(1, 30))] for _ in range(3)]
        sizes = [rng.randint(1, 8000) for _ in range(10)]
        want = [
            sum(padding(pack(list(range(len(g))), dict(enumerate(g)), s)) for g in groups)
            for s in sizes
        ]
        assert padding_by_size(groups, sizes).tolist() == want


def _gpt2_numels(hidden=1024, layers=24, vocab=512, positions=1024) -> list[int]:
    """GPT-2's parameter sizes in first-use order (the LM head is the tied embedding)."""
    block = [hidden, hidden, hidden * 3 * hidden, 3 * hidden, hidden * hidden, hidden]
    block += [hidden, hidden, hidden * 4 * hidden, 4 * hidden, 4 * hidden * hidden, hidden]
    return [vocab * hidden, positions * hidden, *block * layers, hidden, hidden]


def _profile(numels: list[int]) -> Profile:
    names = [f"p{i}" for i in range(len(numels))]
    return Profile(
        params=[ParamInfo(name=n, shape=(k,), numel=k) for n, k in zip(names, numels, strict=True)],
        forward_order=names,
    )


def test_auto_size_of_a_302m_gpt2_wastes_at_most_3_percent():
    numels = _gpt2_numels()
    total = sum(numels)
    old = auto_aim(total, max(numels))
    assert padding_by_size([numels], [old])[0] > 0.04 * total  # why the size is weighed
    chosen = auto_chunk_sizes([numels])[0]
    assert padding_by_size([numels], [chosen])[0] <= PADDING_LIMIT * total


@pytest.mark.parametrize(
    ("params", "optim", "per_element"),
    [("host", "host", {"host": 14}), ("host", "device", {"host": 2, "device": 12})],
)
def test_plan_bytes_are_the_hand_count_at_the_chosen_size(params, optim, per_element):
    numels = _gpt2_numels()
    profile = _profile(numels)
    config = Config(precision="bf16", param_placement=params, optimizer_placement=optim)
    plan = default_plan(profile=profile, hardware=Hardware(device_type="cpu"), config=config)
    chunks = pack(
        [p.name for p in profile.params], {p.name: p.numel for p in profile.params}, plan.chunk_size
    )
    elements = sum(c.capacity for c in chunks)  # every chunk is plan.chunk_size: no oversize
    assert elements == len(chunks) * plan.chunk_size
    got = plan_model_bytes(profile, plan, "bf16")
    assert {tier: n for tier, n in got.items() if n} == {
        tier: k * elements for tier, k in per_element.items()
    }
    assert got["host"] <= (14 * 1.03 if params == optim else 2 * 1.03) * sum(numels)
