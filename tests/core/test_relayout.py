"""Chunks are re-packed in the recorded first-use order after step 1 ([Note: re-layout after warm-up])."""

import copy
import dataclasses

import pytest
import tierwise
import torch
from helpers.models import tiny_model
from helpers.train import run_reference, train
from tierwise.runtime.layout.relayout import relayout

HOST = dict(
    param_placement="host", optimizer_placement="host", cache_blocks=3, chunk_size=5000, prefetch=1
)


def first_use_reference(kind: str) -> list[str]:
    """Parameter names in the order a plain model's modules first run (plain forward hooks)."""
    model = tiny_model(kind)
    order: dict[str, None] = {}
    names = {id(p): n for n, p in model.named_parameters()}

    def hook(module, args):
        for p in module.parameters(recurse=False):
            order.setdefault(names[id(p)])

    for module in model.modules():
        module.register_forward_pre_hook(hook)
    train(model, torch.optim.AdamW(model.parameters()), 1, tierwise_model=False)
    return list(order)


def layout(model) -> list[str]:
    return [s.name for c in tierwise.engine_of(model).chunks() for s in c.slots]


@pytest.mark.parametrize("kind", ["opt", "llama"])
def test_chunks_follow_the_recorded_first_use_order_after_step_one(kind):
    model = tiny_model(kind)
    module_order = [n for n, _ in model.named_parameters()]
    model, opt = tierwise.setup(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), device="cpu", **HOST
    )
    assert layout(model) == module_order  # no profile: module order before the first step
    expected = first_use_reference(kind)
    assert expected != module_order, "the model must define modules out of use order"
    train(model, opt, 1)
    assert layout(model) == expected
    assert tierwise.engine_of(model).layout_note is None


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize(
    "plan",
    [dict(param_placement="device", optimizer_placement="device"), HOST],
    ids=["device", "host"],
)
def test_relayout_changes_no_arithmetic(plan, precision):
    """Re-packing moves params, masters and Adam moments: training continues exactly."""
    model = tiny_model("llama")
    model, opt = tierwise.setup(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01),
        device="cpu",
        precision=precision,
        chunk_size=5000,
        **{k: v for k, v in plan.items() if k != "chunk_size"},
    )
    losses = train(model, opt, 6, clip=1.0)
    if precision == "fp32":
        ref_losses, ref = run_reference("llama", 6, train_kwargs=dict(clip=1.0))
        assert losses == ref_losses
        state = model.state_dict()
        for name, value in ref.state_dict().items():
            assert torch.equal(state[name], value), name
    else:  # the same plan without re-packing (layout already in use order) is the reference
        other = tiny_model("llama")
        other, other_opt = tierwise.setup(
            other,
            torch.optim.AdamW(other.parameters(), lr=1e-2, weight_decay=0.01),
            device="cpu",
            precision=precision,
            chunk_size=5000,
            param_placement="device",
            optimizer_placement="device",
            example_batch=None,
        )
        tierwise.engine_of(other)._relayout_checked = True  # keep module order throughout
        assert train(other, other_opt, 6, clip=1.0) == losses


def test_resume_after_relayout_is_bitwise(tmp_path):
    def fresh():
        model = tiny_model("opt")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        return tierwise.setup(model, opt, device="cpu", **HOST)

    model, opt = fresh()
    train(model, opt, 2)
    tierwise.save_checkpoint(tmp_path / "ckpt", model, opt)
    straight = train(model, opt, 3, first_seed=2)

    resumed, resumed_opt = fresh()
    tierwise.load_checkpoint(tmp_path / "ckpt", resumed, resumed_opt)
    assert layout(resumed) == layout(model)
    assert train(resumed, resumed_opt, 3, first_seed=2) == straight
    assert layout(resumed) == layout(model)
    for name, value in model.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name


def test_relayout_that_does_not_fit_the_budget_keeps_the_layout():
    model = tiny_model("opt")
    module_order = [n for n, _ in model.named_parameters()]
    model, opt = tierwise.setup(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01),
        device="cpu",
        precision="fp32",
        param_placement="device",
        optimizer_placement="device",
        chunk_size=5000,
    )
    engine = tierwise.engine_of(model)
    engine.tiers["device"].budget = engine.tiers["device"].used_bytes - 1  # no room at all
    losses = train(model, opt, 3)
    assert "budget" in engine.layout_note
    assert layout(model) == module_order
    assert losses == run_reference("opt", 3)[0]


def test_relayout_returns_what_it_did_and_the_engine_applies_it():
    """``relayout`` re-packs the chunk groups and returns a ``Relayout``; the plan changes only
    when its owner applies that, and ``before_move`` runs once, only when a group moves."""
    model = tiny_model("opt")
    model, _ = tierwise.setup(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), device="cpu", **HOST
    )
    engine = tierwise.engine_of(model)
    plan = engine.plan
    for name in plan.param_tiers:  # markers: relayout must leave them, apply_to replace them
        plan.param_tiers[name] = ["marker"]
        plan.groups[name]["chunks"] = -1
    plan_before = copy.deepcopy((plan.param_tiers, plan.groups))
    order = first_use_reference("opt")
    calls = []
    engine.residency.invalidate_cache()
    result = relayout(engine.layout_parts(), order, before_move=lambda: calls.append("moved"))
    assert calls == ["moved"] and result.moved and result.note is None
    assert [s.name for g in engine.groups for c in g.chunks for s in c.slots] == order
    assert (plan.param_tiers, plan.groups) == plan_before  # not applied yet
    result.apply_to(plan)
    for name in result.moved:
        group = next(g for g in engine.groups if g.name == name)
        assert (
            plan.param_tiers[name]
            == [c.home.tier.name for c in group.chunks]
            == ["host"] * len(group.chunks)
        )
        assert plan.groups[name]["chunks"] == len(group.chunks)
    again = relayout(engine.layout_parts(), order, before_move=lambda: calls.append("again"))
    assert again.moved == [] and calls == ["moved"]  # the layout is that order already
    engine.close()


def _opt(plan: dict, **config):
    model = tiny_model("opt")  # defines final_layer_norm before its layers: re-packed
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    model, opt = tierwise.setup(model, opt, device="cpu", precision="fp32", **plan, **config)
    return model, opt, tierwise.engine_of(model)


def _largest_shard(engine) -> int:
    return max(c.shard_size for c in engine.chunks())


def test_re_packing_holds_one_new_chunk_and_one_old_chunk_of_host_memory():
    """[Note: re-packing holds host memory]: with room for the new slabs beside the old ones,
    a kind is re-packed a new chunk at a time: the host holds one new fp32 shard and one old
    fp32 shard read (unsharded), reserved in the host tier while it runs; training is exact."""
    model, opt, engine = _opt(HOST)
    before, old_largest = layout(model), _largest_shard(engine)
    losses = train(model, opt, 3)
    assert layout(model) != before and engine.layout_note is None  # re-packed
    held = engine.stats()["memory"]["relayout_buffers"]
    assert held["peak_bytes"] == 4 * (_largest_shard(engine) + old_largest)
    assert held["bytes"] == 0 and held["within"] == "host"
    assert engine.tiers["host"].peak_bytes >= held["peak_bytes"]
    assert losses == run_reference("opt", 3)[0]
    engine.close()


def test_re_packing_without_room_beside_the_old_slabs_holds_the_kind_whole():
    """Device tier budget with room for the new layout but not for a kind's new slabs beside
    its old ones: each kind's new shards are built in host memory before the old slabs go (all
    new fp32 shards plus one old shard read), counted; training is exact."""
    model, opt, engine = _opt(dict(param_placement="device", optimizer_placement="device"))
    model_order, old_largest = layout(model), _largest_shard(engine)
    device = engine.tiers["device"]
    device.budget = device.used_bytes + 4 * old_largest  # the padding may differ, not a kind
    losses = train(model, opt, 3)
    assert layout(model) != model_order and engine.layout_note is None
    whole = sum(c.shard_size for c in engine.chunks())
    assert engine.stats()["memory"]["relayout_buffers"]["peak_bytes"] == 4 * (whole + old_largest)
    assert device.peak_bytes <= device.budget
    assert losses == run_reference("opt", 3)[0]
    engine.close()


def test_a_host_budget_without_room_for_re_packing_keeps_the_layout_with_a_note():
    """A host budget with room for the model data but not for a kind's re-packing buffers:
    the group keeps its setup layout, the note says how much it needed, and the host tier
    never went over its budget; training is exact."""
    _, _, engine = _opt(HOST)
    data, largest = engine.tiers["host"].used_bytes, _largest_shard(engine)
    engine.close()
    model, opt, engine = _opt(HOST, host_memory=data + 2 * 4 * largest)
    before = layout(model)
    losses = train(model, opt, 3)
    assert layout(model) == before
    note = engine.layout_note
    assert "re-packing its" in note and "host tier has room for" in note, note
    assert engine.tiers["host"].peak_bytes <= engine.tiers["host"].budget
    assert engine.stats()["memory"]["relayout_buffers"]["peak_bytes"] == 0
    assert losses == run_reference("opt", 3)[0]
    engine.close()


@pytest.mark.parametrize("ranks_per_node", [1, 2])
def test_without_a_host_budget_re_packing_holds_at_most_half_the_rank_s_share(ranks_per_node):
    """No host_memory: a kind's re-packing buffers may take half this rank's share of the free
    RAM the probe saw ([Note: a rank's host share]), not half the node's. Free RAM twice the
    largest hold: one rank re-packs; each of two ranks on the node has half that and keeps the
    layout with a note. Training is exact either way."""
    model, opt, engine = _opt(HOST)
    train(model, opt, 3)
    hold = engine.stats()["memory"]["relayout_buffers"]["peak_bytes"]  # the largest kind's
    engine.close()
    assert hold > 0
    model, opt, engine = _opt(HOST)
    engine.hardware = dataclasses.replace(
        engine.hardware, host_memory=2 * hold, world_size=2, gpus_per_node=ranks_per_node
    )
    before = layout(model)
    losses = train(model, opt, 3)
    if ranks_per_node == 1:
        assert layout(model) != before and engine.layout_note is None
    else:
        assert layout(model) == before
        assert "re-packing holds" in engine.layout_note, engine.layout_note
    assert losses == run_reference("opt", 3)[0]
    engine.close()
