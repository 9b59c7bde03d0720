"""``host_memory`` is the node's: each of its ranks plans and runs with its share ([Note: a rank's
host share]). Two gloo ranks on one node (LOCAL_WORLD_SIZE unset: ranks_per_node = world), with
core's planner alone and with the search:
- a refusal names the node's budget: 1 byte under it is refused with the same need, and at it
  each rank's host tier gets half of it, and 2 steps keep the ledger's host peaks, summed over
  the ranks, within it;
- a budget that plans one rank (its stated minimum) is refused for two;
- both planners state the same node need for the same plan."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("tierwise_search")

import tierwise  # noqa: E402
from helpers.models import tiny_model  # noqa: E402
from helpers.multiproc import run_ranks  # noqa: E402
from helpers.train import train  # noqa: E402
from tierwise.plan import PlanError  # noqa: E402
from tierwise.units import format_gib  # noqa: E402

# a rank holds the whole model (shard=False) in host memory, so two ranks need twice one's
PLACEMENT = dict(
    precision="fp32",
    chunk_size=5000,
    param_placement="host",
    optimizer_placement="host",
    cache_blocks=3,
    shard=False,
)
PLANNERS = {"core": "search,profiler", "search": "profiler"}
"""Planner -> the plugins disabled to get it (the profiler's hardware probe measures in every
process, and no figure here depends on it)."""


def _setup(host_memory):
    model = tiny_model("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return tierwise.setup(model, opt, device="cpu", host_memory=host_memory, **PLACEMENT)


def _refusal(host_memory) -> PlanError:
    with pytest.raises(PlanError) as info:
        _setup(host_memory)
    assert info.value.tier == "host"
    return info.value


def _on_two_ranks(rank: int, world: int, one_rank_minimum: dict) -> dict:
    results = {}
    for planner, disabled in PLANNERS.items():
        os.environ["TIERWISE_DISABLE_PLUGINS"] = disabled
        first = _refusal(1)
        node_need = first.need
        below = _refusal(node_need - 1)
        fits_one = _refusal(one_rank_minimum[planner])
        model, opt = _setup(node_need)
        engine = tierwise.engine_of(model)
        try:
            assert engine.plan.planner == planner
            train(model, opt, 2)
            host = engine.stats()["memory"]["host"]
        finally:
            engine.close()
        results[planner] = {
            "node_need": node_need,
            "message": str(first),
            "limit": first.limit,
            "below": (below.need, below.limit),
            "fits_one": (fits_one.need, fits_one.limit),
            "budget": host["budget"],
            "peak": host["peak_bytes"],
            "rank_need": engine.plan.host_need,
        }
    return results


def test_a_node_budget_is_shared_by_its_ranks(monkeypatch):
    one_rank_minimum = {}
    for planner, disabled in PLANNERS.items():
        monkeypatch.setenv("TIERWISE_DISABLE_PLUGINS", disabled)
        need = _refusal(1).need
        model, _ = _setup(need)  # one rank plans at its stated minimum
        engine = tierwise.engine_of(model)
        assert engine.plan.planner == planner
        engine.close()
        one_rank_minimum[planner] = need
    monkeypatch.delenv("TIERWISE_DISABLE_PLUGINS")

    ranks = run_ranks(_on_two_ranks, 2, one_rank_minimum)

    for planner in PLANNERS:
        got = [r[planner] for r in ranks]
        node_need = got[0]["node_need"]
        assert {r["node_need"] for r in got} == {node_need}
        # stated in the node's unit: twice what one rank needs at its share
        assert node_need == 2 * got[0]["rank_need"]
        assert node_need >= 2 * one_rank_minimum[planner]
        assert got[0]["limit"] == 1
        assert "shared by 2 ranks" in got[0]["message"]
        assert f"raise host_memory to at least {format_gib(node_need)}" in got[0]["message"]
        for result in got:
            assert result["below"] == (node_need, node_need - 1)
            # what plans one rank is refused for two, naming the same node need
            assert result["fits_one"] == (node_need, one_rank_minimum[planner])
            assert result["budget"] == node_need // 2  # the rank's host tier holds its share
        assert sum(r["peak"] for r in got) <= node_need
        assert all(r["peak"] > 0 for r in got)
    # both planners count the same bytes for this plan and state the same node need
    assert ranks[0]["core"]["node_need"] == ranks[0]["search"]["node_need"]
