"""Plan.activation_checkpointing is what runs (issue 28, defect 9): a planner that chooses
checkpointing gets every block recomputed, exactly as Config.activation_checkpointing=True."""

from __future__ import annotations

import pytest
import tierwise
import torch
from helpers.models import tiny_model
from helpers.train import train
from tierwise import api
from tierwise.hookspecs import hookimpl
from tierwise.plugins import build_plugin_manager


class CheckpointingPlanner:
    @hookimpl(tryfirst=True)
    def tierwise_make_plan(self, profile, hardware, config):
        from tierwise.planning.planner import default_plan

        plan = default_plan(profile=profile, hardware=hardware, config=config)
        plan.activation_checkpointing = True
        return plan


@pytest.fixture
def checkpointing_planner(monkeypatch):
    host = build_plugin_manager(load_entry_points=False)
    host.pm.register(CheckpointingPlanner(), name="checkpointing_planner")
    monkeypatch.setattr(api, "get_plugin_host", lambda: host)


def _run(**config):
    model = tiny_model("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = tierwise.setup(model, opt, device="cpu", precision="fp32", **config)
    losses = train(model, opt, 2)
    engine = tierwise.engine_of(model)
    policy, recomputed = (
        dict(engine.plan.activation_policy),
        engine.stats()["activations"]["recomputed_blocks"],
    )
    state = {k: v.clone() for k, v in model.state_dict().items()}
    engine.close()
    return losses, policy, recomputed, state


def test_a_plan_that_chooses_checkpointing_recomputes_every_block(checkpointing_planner):
    losses, policy, recomputed, state = _run()
    assert policy and set(policy.values()) == {"recompute"}
    assert recomputed == len(policy)
    want_losses, want_policy, want_recomputed, want_state = _run(activation_checkpointing=True)
    assert (policy, recomputed) == (want_policy, want_recomputed)
    assert losses == want_losses
    for key, value in want_state.items():
        assert torch.equal(state[key], value), key
