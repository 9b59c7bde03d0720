"""The plan describes every chunk group: pattern, data-parallel size, chunks, tiers."""

import tierwise
import torch
from helpers.models import tiny_model


def test_plan_table_shows_each_chunk_group():
    model = tiny_model("gpt2")
    model.transformer.wpe.requires_grad_(False)
    opt = torch.optim.AdamW(p for p in model.parameters() if p.requires_grad)
    model, _ = tierwise.setup(model, opt, device="cpu", param_placement="host", cache_blocks=3)
    plan = tierwise.engine_of(model).plan
    table = plan.table()
    engine_groups = tierwise.engine_of(model).groups
    assert {g.name for g in engine_groups} == {"data/g0/train", "data/g0/frozen"}
    for group in engine_groups:
        assert f"group {group.name}" in table
        assert f"pattern data, DP 1, {len(group.chunks)} chunks" in table
    assert type(plan).from_json(plan.to_json()).groups == plan.groups
