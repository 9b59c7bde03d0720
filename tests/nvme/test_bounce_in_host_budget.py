"""The NVMe tier's bounce buffers are inside the host budget (issue 36, [Note: bounce buffers
in the host budget] in tierwise_nvme.buffers): setup sizes them for the plan's chunks and
reserves them in the host tier, planners count the same bytes, training never holds more, and a
host budget without room for them is refused before the model changes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("tierwise_nvme")

import tierwise  # noqa: E402
from helpers.models import tiny_model  # noqa: E402
from helpers.train import train  # noqa: E402
from nvme_helpers import bounce_budget_bytes, nvme_pool_bytes  # noqa: E402
from tierwise.plan import PlanError  # noqa: E402
from tierwise.tiers import TierBudgetError  # noqa: E402
from tierwise_nvme import NVMeTier  # noqa: E402
from tierwise_nvme.options import ALIGNMENT  # noqa: E402

PLAN = dict(device="cpu", precision="fp32", chunk_size=5000, cache_blocks=3)


def build(nvme_dir, **config):
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return (
        model,
        opt,
        lambda: tierwise.setup(
            model,
            opt,
            nvme_path=str(nvme_dir),
            param_placement="nvme",
            optimizer_placement="host",
            **PLAN,
            **config,
        ),
    )


def bounce_entry(engine) -> dict:
    return engine.stats()["memory"]["nvme_bounce_buffers"]


def test_the_bounce_buffers_are_reserved_in_the_host_budget_and_stay_within_it(nvme_dir):
    """Parameters on NVMe, states on host: each step writes the updated chunk homes back, a
    whole chunk through a bounce buffer when its address and file offset disagree. The pool is
    counted by the host tier (``within`` "host"), its budget is what setup reserved, large
    enough for a whole chunk, its peak stays within it, and the host tier's peak within
    host_memory."""
    _, _, setup = build(nvme_dir)
    model, _ = setup()
    engine = tierwise.engine_of(model)
    need = engine.tiers["host"].used_bytes  # what an unbudgeted setup reserves in the host tier
    engine.close()

    host_memory = need + (1 << 20)
    _, _, setup = build(nvme_dir, host_memory=host_memory)
    model, opt = setup()
    engine = tierwise.engine_of(model)
    try:
        nvme = engine.tiers["nvme"]
        chunk_bytes = 4 * max(c.capacity for c in engine.chunks())
        budget = bounce_budget_bytes(nvme)
        assert budget >= chunk_bytes + 3 * ALIGNMENT  # a whole widened chunk and its alignment
        train(model, opt, 2)
        entry = bounce_entry(engine)
        assert entry["within"] == "host" and entry["budget"] == budget
        assert 0 < entry["peak_bytes"] <= budget  # bounces happened, within the reservation
        assert engine.stats()["peak_bytes_by_tier"]["host"] <= host_memory
        # the ledger's host-RAM bound does not count the pool twice
        report = engine.stats()["memory"]
        outside = [k for k, e in report.items() if e["memory"] == "host" and e["within"] is None]
        assert "nvme_bounce_buffers" not in outside
    finally:
        engine.close()


def test_the_planned_host_buffers_are_what_setup_reserves(make_tier):
    """A planner's figure (``planned_host_buffer_bytes`` with the chunk's bytes) equals what a
    tier sized for the same chunk reserves, bounce buffers included."""
    tier = make_tier("threads")
    chunk_bytes = 4 * 300_000
    without = tier.host_buffer_bytes()
    tier.size_host_buffers(transfer_bytes=chunk_bytes)
    sized = tier.host_buffer_bytes()
    assert sized - without == bounce_budget_bytes(tier) >= chunk_bytes
    planned = NVMeTier.planned_host_buffer_bytes(tier.config, transfer_bytes=chunk_bytes)
    assert planned == sized


def test_a_host_budget_without_room_for_the_bounce_buffers_is_refused_before_the_model_changes(
    nvme_dir,
):
    """A host budget that holds the slabs and the smallest staged-read pool but half the
    bounce buffers: refused (the plan's or
    the host tier's error, one line naming the host budget and what to change), the model left
    as it was."""
    _, _, setup = build(nvme_dir)
    model, _ = setup()
    engine = tierwise.engine_of(model)
    rest = engine.tiers["host"].used_bytes - nvme_pool_bytes(engine)  # slabs, grad buffers
    read_buffer = engine.tiers["nvme"].staging.buffer_bytes  # the staged reads' least: one
    bounces = bounce_budget_bytes(engine.tiers["nvme"])  # sized by the chunk, not the budget
    engine.close()

    smallest = rest + read_buffer + bounces
    model, _, setup = build(nvme_dir, host_memory=smallest - bounces // 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises((PlanError, TierBudgetError), match="host") as info:
        setup()
    message = str(info.value)
    assert "\n" not in message and "raise" in message  # the limit, the need, the remedy
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
