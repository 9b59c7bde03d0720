"""Core's planner alone (the search plugin disabled) counts the NVMe tier's own host buffers
(staged reads, bounce buffers, the optimizer pipeline) with the function the search uses
(``storage_tier_host_bytes``, the tier's ``planned_host_buffer_bytes``): its ``host_need`` is
what setup reserves in the host tier, the ledger's host peak over 2 steps after the warm-up
stays within it, and
its stated host minimum is the least budget that plans ([Note: the stated host minimum is a
fixed point])."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("tierwise_nvme")

import tierwise  # noqa: E402
from helpers.models import tiny_model  # noqa: E402
from helpers.train import train  # noqa: E402
from tierwise.plan import PlanError  # noqa: E402

PLACEMENTS = [
    dict(precision="fp32", param_placement="host", optimizer_placement="nvme"),
    dict(precision="bf16", param_placement="nvme", optimizer_placement="nvme", cache_blocks=3),
]


@pytest.fixture(autouse=True)
def _core_planner(monkeypatch):
    monkeypatch.setenv("TIERWISE_DISABLE_PLUGINS", "search")


def _setup(nvme_dir, **config):
    model = tiny_model("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return tierwise.setup(
        model, opt, device="cpu", chunk_size=5000, nvme_path=str(nvme_dir), **config
    )


@pytest.mark.parametrize("config", PLACEMENTS, ids=["host-params", "nvme-params"])
def test_the_core_plans_host_need_is_what_the_engine_holds(nvme_dir, config):
    model, opt = _setup(nvme_dir, host_memory="64MiB", **config)
    engine = tierwise.engine_of(model)
    try:
        plan = engine.plan
        assert plan.planner == "core"
        assert engine.stats()["memory"]["nvme_staging"]["budget"] > 0  # the pools exist
        # setup's reservations: slabs, gradient offload buffers, the NVMe tier's pools
        assert engine.tiers["host"].used_bytes == plan.host_need
        # the warm-up step's re-layout holds host memory only where the budget has room beyond
        # the plan ([Note: re-packing holds host memory]); the 2 steps after it hold the plan's
        train(model, opt, 1)
        engine.tiers["host"].reset_peak()
        train(model, opt, 2)
        host = engine.stats()["memory"]["host"]
        assert 0 < host["peak_bytes"] <= plan.host_need
    finally:
        engine.close()


@pytest.mark.parametrize("config", PLACEMENTS, ids=["host-params", "nvme-params"])
def test_the_core_plans_stated_host_minimum_trains_and_one_byte_less_is_refused(nvme_dir, config):
    with pytest.raises(PlanError) as info:
        _setup(nvme_dir, host_memory=1, **config)
    need = info.value.need
    assert info.value.tier == "host" and "storage tiers' host buffers" in str(info.value)
    with pytest.raises(PlanError) as below:
        _setup(nvme_dir, host_memory=need - 1, **config)
    assert (below.value.tier, below.value.need) == ("host", need)
    model, opt = _setup(nvme_dir, host_memory=need, **config)
    engine = tierwise.engine_of(model)
    try:
        assert engine.plan.planner == "core" and engine.plan.host_need <= need
        train(model, opt, 2)  # a TierBudgetError would fail here
        host = engine.stats()["memory"]["host"]
        assert host["budget"] == need and host["peak_bytes"] <= need
    finally:
        engine.close()
