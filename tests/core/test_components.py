"""Core as components (issue 17): a plugin's tier can be a plan's default, and closing an
engine gives back what it took from the model and the device tier."""

from __future__ import annotations

import pytest
import tierwise
import torch
from helpers.models import tiny_model
from helpers.train import max_rel_diff, run_reference, train
from tierwise import api
from tierwise.hookspecs import hookimpl
from tierwise.plan import PlanError
from tierwise.plugins import build_plugin_manager
from tierwise.tiers import HostTier


class SpareRamTier(HostTier):
    """Host memory under a name no core planner knows: a tier only this test registers."""

    PLUGIN_NAME = "spare_ram"


class SpareRamPlugin:
    """Registers SpareRamTier and plans every chunk's parameters and states onto it."""

    @hookimpl
    def tierwise_register_tiers(self):
        return [SpareRamTier]

    @hookimpl(tryfirst=True)
    def tierwise_make_plan(self, profile, hardware, config):
        from tierwise.planning.planner import default_plan

        plan = default_plan(profile=profile, hardware=hardware, config=config)
        plan.param_tier = plan.optim_tier = "spare_ram"
        plan.param_tiers, plan.optim_tiers = {}, {}
        return plan


@pytest.fixture
def host_with_spare_ram(monkeypatch):
    host = build_plugin_manager(load_entry_points=False)
    host.pm.register(SpareRamPlugin(), name="spare_ram_plugin")
    monkeypatch.setattr(api, "get_plugin_host", lambda: host)
    return host


def test_plugin_tier_is_a_plans_default_tier(host_with_spare_ram):
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    # the host placement gives the rCache its blocks; the plugin's planner then moves to its tier
    # every chunk the default planner put on the host
    model, opt = tierwise.setup(
        model,
        opt,
        device="cpu",
        precision="fp32",
        param_placement="host",
        optimizer_placement="host",
    )
    engine = tierwise.engine_of(model)
    assert engine.plan.param_tier == engine.plan.optim_tier == "spare_ram"
    assert {c.home.tier.name for c in engine.chunks()} == {"spare_ram"}
    assert {c.optim.tier.name for c in engine.chunks() if c.trainable} == {"spare_ram"}
    assert engine.tiers["spare_ram"].used_bytes > 0
    losses = train(model, opt, 3)
    ref_losses, reference = run_reference("gpt2", 3)
    for a, b in zip(losses, ref_losses, strict=True):  # as test_reference's fp32 case
        assert abs(a - b) <= 1e-6 * abs(b)
    assert max_rel_diff(model.state_dict(), reference) <= 1e-6


def test_plan_naming_an_unregistered_tier_is_refused_before_setup_changes_anything(monkeypatch):
    host = build_plugin_manager(load_entry_points=False)

    class Planner:
        @hookimpl(tryfirst=True)
        def tierwise_make_plan(self, profile, hardware, config):
            from tierwise.planning.planner import default_plan

            plan = default_plan(profile=profile, hardware=hardware, config=config)
            plan.optim_tier = "tape"
            return plan

    host.pm.register(Planner(), name="tape_planner")
    monkeypatch.setattr(api, "get_plugin_host", lambda: host)
    model = tiny_model("gpt2")
    with pytest.raises(PlanError, match="'tape' tier, which no installed plugin provides"):
        tierwise.setup(model, torch.optim.AdamW(model.parameters()), device="cpu")
    assert not hasattr(model, "_tierwise_engine")


def _hook_counts(model: torch.nn.Module) -> dict[str, int]:
    modules = list(model.modules())
    return {
        "forward_pre": sum(len(m._forward_pre_hooks) for m in modules),
        "forward": sum(len(m._forward_hooks) for m in modules),
        "state_dict": sum(len(m._state_dict_hooks) for m in modules),
        "param": sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()),
    }


def test_close_gives_back_the_rcache_reservation_and_removes_every_hook():
    model = tiny_model("gpt2")
    before = _hook_counts(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # parameters on the host: the rCache holds device blocks for them
    model, opt = tierwise.setup(model, opt, device="cpu", param_placement="host", cache_blocks=6)
    engine = tierwise.engine_of(model)
    device = engine.tiers["device"]
    assert engine.cache.reserved > 0
    assert all(n > before[k] for k, n in _hook_counts(model).items())
    train(model, opt, 1)
    used, reserved = device.used_bytes, engine.cache.reserved
    engine.close()
    assert device.used_bytes == used - reserved
    assert _hook_counts(model) == before
