"""[PLAN36 item 4, in part; FIXPT] An engine built at the minimum budget the planner states (the
``need`` of its refusal at a budget of 1 byte) trains 2 steps with no ``TierBudgetError``, and
one byte less is refused: the stated minimum is the least budget that plans ([Note: the stated
host minimum is a fixed point]: with NVMe states the NVMe tier's host buffers grow with
``host_memory``, so the first refusal used to name 4.38 MiB and planning there asked 4.55 MiB). With every plugin installed (the
search plugin answers, as ``tierwise train`` installs it): ``combined``, [Note: one env per
test]."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("tierwise_nvme")
pytest.importorskip("tierwise_search")
pytestmark = pytest.mark.combined

import tierwise  # noqa: E402
from helpers.models import tiny_model  # noqa: E402
from helpers.train import train  # noqa: E402
from tierwise.plan import PlanError  # noqa: E402

BASE = dict(device="cpu", chunk_size=5000)


def _setup(**config):
    model = tiny_model("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return tierwise.setup(model, opt, **BASE, **config)


def _minimum(tier: str, **config) -> int:
    """The planner's stated minimum of ``tier``'s budget: what it says a 1-byte budget needs."""
    with pytest.raises(PlanError) as info:
        _setup(**{f"{tier}_memory": 1}, **config)
    assert info.value.tier == tier
    return info.value.need


@pytest.mark.parametrize(
    "tier,config",
    [
        ("device", dict(precision="fp32")),
        ("device", dict(precision="bf16")),
        ("host", dict(precision="fp32", param_placement="host", optimizer_placement="nvme")),
        ("host", dict(precision="bf16", param_placement="host", optimizer_placement="host")),
    ],
    ids=["device-fp32", "device-bf16", "host-fp32-nvme-states", "host-bf16"],
)
def test_an_engine_at_the_planned_minimum_trains(nvme_dir, tier, config):
    if config.get("optimizer_placement") == "nvme":
        config = {**config, "nvme_path": str(nvme_dir)}
    need = _minimum(tier, **config)
    with pytest.raises(PlanError) as below:
        _setup(**{f"{tier}_memory": need - 1}, **config)
    assert below.value.tier == tier and below.value.need == need
    model, opt = _setup(**{f"{tier}_memory": need}, **config)
    engine = tierwise.engine_of(model)
    try:
        train(model, opt, 2)  # a TierBudgetError would fail here
        entry = engine.stats()["memory"][tier]
        assert entry["budget"] == need and entry["peak_bytes"] <= need
    finally:
        engine.close()
