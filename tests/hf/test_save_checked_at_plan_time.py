"""save_pretrained is checked at plan time ([Note: the weight load checked at plan time]): with
Config.saves_weights, a host budget with room for training but not for the save buffers beside
the model data is refused by the plan, before any model data is built, naming the least budget
that saves; at that budget the model trains and saves, and the file holds what plain
``save_pretrained`` writes. Without it the save itself refuses first, naming that budget."""

from __future__ import annotations

import pytest
import safetensors.torch
import tierwise
import torch
from helpers.host_minimum import named_host_minimum, refused_below
from helpers.models import tiny_model
from helpers.train import train
from tierwise.plan import PlanError
from tierwise.tiers.base import TierBudgetError

OPTIONS = dict(
    device="cpu",
    precision="fp32",
    chunk_size=4096,
    param_placement="host",
    optimizer_placement="host",
)


def _setup(host_memory, **options):
    model = tiny_model("gpt2", seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return tierwise.setup(model, optimizer, host_memory=host_memory, **OPTIONS, **options)


def _tensors(folder):
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(safetensors.torch.load_file(file))
    return out


def _saver_need(tmp_path) -> int:
    """What a save takes in the host tier, measured without any check: the host tier's peak
    while ``save_pretrained`` runs after two steps of training."""
    model, optimizer = _setup(host_memory=None)
    engine = tierwise.engine_of(model)
    try:
        train(model, optimizer, 2)
        host = engine.tiers["host"]
        host.reset_peak()
        model.save_pretrained(tmp_path / "unchecked")
        return host.peak_bytes
    finally:
        engine.close()


def test_the_plan_refuses_a_budget_without_room_for_the_save(tmp_path):
    need = _saver_need(tmp_path)

    refused_below(lambda budget: _setup(host_memory=budget, saves_weights=True), need, "save")

    reference = tiny_model("gpt2", seed=0)  # the same values, never managed
    reference.save_pretrained(tmp_path / "plain")
    model, optimizer = _setup(host_memory=need, saves_weights=True)
    engine = tierwise.engine_of(model)
    try:
        model.save_pretrained(tmp_path / "managed")
        plain, managed = _tensors(tmp_path / "plain"), _tensors(tmp_path / "managed")
        assert plain.keys() == managed.keys()
        assert all(torch.equal(managed[n], plain[n]) for n in plain)
        train(model, optimizer, 2)
        model.save_pretrained(tmp_path / "trained")  # fits after training too
        host = engine.stats()["memory"]["host"]
        assert host["budget"] == need and host["peak_bytes"] <= need
    finally:
        engine.close()


def test_without_the_flag_the_save_refuses_at_its_call_naming_the_budget(tmp_path):
    need = _saver_need(tmp_path)
    model, optimizer = _setup(host_memory=need - 1)  # plans: only training is checked
    engine = tierwise.engine_of(model)
    try:
        train(model, optimizer, 1)
        with pytest.raises(TierBudgetError) as info:
            model.save_pretrained(tmp_path / "out")
        message = str(info.value)
        assert "save_pretrained needs" in message and "Config.saves_weights=True" in message
        assert "raise host_memory to at least" in message
        assert not (tmp_path / "out").exists()  # refused before anything was written
        assert engine.tiers["host"].used_bytes + engine.plan.io_buffer_bytes == need
    finally:
        engine.close()


def test_the_trainer_checks_the_save_unless_told_otherwise(tmp_path):
    """TierwiseTrainer saves checkpoints and models through save_pretrained, so it sets
    Config.saves_weights unless its tierwise_config says otherwise."""
    from hf_helpers import TokenBlocks, training_args
    from tierwise.integrations.hf import TierwiseTrainer

    def trainer(host_memory, **config):
        made = TierwiseTrainer(
            model=tiny_model("gpt2", seed=0),
            args=training_args(tmp_path / "run", max_steps=1),
            train_dataset=TokenBlocks(),
            tierwise_config={**OPTIONS, "host_memory": host_memory, **config},
        )
        return tierwise.engine_of(made.model)

    engine = trainer(None)  # the Trainer's own optimizer groups: its own host need
    need = engine.tiers["host"].used_bytes + engine.plan.io_buffer_bytes
    engine.close()
    with pytest.raises(PlanError, match="while weights save") as info:
        trainer(need - 1)
    assert info.value.need == need
    trainer(need - 1, saves_weights=False).close()  # told otherwise: training alone is checked


@pytest.mark.combined
def test_the_search_keeps_room_for_the_save_it_was_refused_for(tmp_path):
    """With the search plugin and automatic placement (NVMe allowed), the refusal at a 1-byte
    budget names a budget that plans and saves; the moves the search makes for speed leave the
    whole save buffers free (Config.saves_weights), so at that budget the model trains and
    saves within it, and one byte less is refused."""
    options = dict(
        device="cpu",
        precision="fp32",
        chunk_size=5000,
        device_memory=200_000,
        nvme_path=str(tmp_path / "nvme"),
        saves_weights=True,
    )

    def setup(host_memory):
        model = tiny_model("llama", seed=0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return tierwise.setup(model, optimizer, host_memory=host_memory, **options)

    need = named_host_minimum(setup, "plans and saves")
    model, optimizer = setup(need)
    engine = tierwise.engine_of(model)
    try:
        assert engine.plan.planner == "search"
        assert engine.plan.host_need + engine.plan.io_buffer_bytes <= need
        train(model, optimizer, 2)
        model.save_pretrained(tmp_path / "out")
        host = engine.stats()["memory"]["host"]
        assert host["budget"] == need and host["peak_bytes"] <= need
    finally:
        engine.close()
